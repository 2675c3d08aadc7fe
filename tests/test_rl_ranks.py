"""The demo's driver asking its trainer ranks: an answer, a rank that dies, one that hangs."""

import asyncio
import multiprocessing as mp
import os
import threading

import pytest

from rlferry.rl._ranks import ask

CTX = mp.get_context("spawn")


def _rank(conn, how):
    cmd = conn.recv()
    if how == "answers":
        conn.send(("ok", {"echo": list(cmd)}))
    elif how == "fails":
        conn.send(("error", f"rank 0: {cmd[0]} failed: out of memory"))
    elif how == "dies":
        os._exit(3)
    threading.Event().wait(60)  # "hangs": alive, never answers


@pytest.fixture
def rank():
    started = []

    def start(how):
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_rank, args=(child, how), daemon=True)
        proc.start()
        started.append(proc)
        return parent

    yield start
    for proc in started:
        proc.kill()
        proc.join(10)


def test_a_rank_answers_and_its_error_comes_as_it_said(rank):
    assert asyncio.run(ask(rank("answers"), 0, "train", 3)) == {"echo": ["train", 3]}
    with pytest.raises(RuntimeError) as e:
        asyncio.run(ask(rank("fails"), 0, "train", 3))
    assert str(e.value) == "rank 0: train failed: out of memory"


def test_a_rank_that_dies_or_hangs_fails_the_call_at_once_or_at_its_bound(rank):
    with pytest.raises(EOFError) as e:  # the pipe closed: known as soon as the rank is gone
        asyncio.run(ask(rank("dies"), 1, "train", 3))
    assert str(e.value) == (
        "trainer rank 1 is gone: its pipe closed before it answered 'train' (its output says why)"
    )
    with pytest.raises(TimeoutError) as e:
        asyncio.run(ask(rank("hangs"), 1, "push", 3, 5.0, timeout=2.0))
    assert str(e.value) == (
        "trainer rank 1 did not answer 'push' within 2 s (its process is alive: see its output "
        "for where it stopped)"
    )
