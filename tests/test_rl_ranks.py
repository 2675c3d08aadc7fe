"""The demo's driver asking its trainer ranks: an answer, a rank that dies, one that hangs;
a step held while the update before it pushes on the rank's thread."""

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
def spawned():
    """``start(target, *args)``: ``target(conn, *args)`` in a process; the driver's end of
    its pipe. Every process is killed at the test's end."""
    started = []

    def start(target, *args):
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=target, args=(child, *args), daemon=True)
        proc.start()
        started.append(proc)
        return parent

    yield start
    for proc in started:
        proc.kill()
        proc.join(10)


@pytest.fixture
def rank(spawned):
    return lambda how: spawned(_rank, how)


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


def _pushing_rank(conn, fail_version):
    """A rank's command loop as the demo's (``Pushes``), with a push that takes 0.2 s (or
    fails for ``fail_version``): the commands its loop got (those of a held step go to
    ``Pushes.hold``), in order, and the pushes that ended before its step."""
    import time

    import torch

    from rlferry.rl.trainer._pushing import Pushes
    from rlferry.weights import WeightSyncError

    received, ended = [], []

    def push(version, seconds):
        time.sleep(0.2)
        if version == fail_version:
            raise WeightSyncError("engine0 is gone mid-push")
        ended.append(version)
        return 100 * version

    pushes = Pushes(0, conn, push, torch.device("cpu"))
    while True:
        cmd = conn.recv()
        received.append(cmd[0])
        if cmd[0] == "push":
            pushes.start(cmd[1], cmd[2])
            continue
        hold = cmd[0] == "train" and cmd[2]
        if not hold:
            pushes.join()
        if cmd[0] == "stop":
            break
        if hold and not pushes.hold():  # its "go" or "stop", and the pushes meanwhile
            received.append("stop")
            break
        pushes.send(("ok", {"ended": list(ended), "held_seconds": 0.0}))
    pushes.wait()
    conn.send(("ended", received, ended))


@pytest.fixture
def pushing_rank(spawned):
    return lambda fail_version=None: spawned(_pushing_rank, fail_version)


def test_a_held_step_gets_its_batch_while_the_update_pushes_and_steps_once_it_ended(
    pushing_rank,
):
    from rlferry.rl._ranks import pusher, train

    conn = pushing_rank()

    async def main():
        sent, pushed = [], []
        pushing = asyncio.Event()
        update = asyncio.ensure_future(pusher([conn], 3, sent, pushed, pushing)(5.0))
        [answer] = await train([conn], 4, update, pushing)
        assert update.result() == {"seconds": pushed[0], "bytes": [300]}
        return answer["ended"]

    # the push command went first (the rank pushes on its thread while it gets its batch),
    # and the step came once the push ended and the driver said go
    assert asyncio.run(main()) == [3]
    conn.send(("stop",))
    assert conn.recv() == ("ended", ["push", "train", "stop"], [3])  # "go": read by hold


def test_a_held_step_runs_an_update_pushed_again_and_a_failed_push_is_the_steps_error(
    pushing_rank,
):
    from rlferry.rl._ranks import pusher, train

    conn = pushing_rank(fail_version=3)

    async def main():
        pushing = asyncio.Event()

        async def update():  # the first push fails (an engine lost): pushed again
            with pytest.raises(RuntimeError) as e:
                await pusher([conn], 3, [], None, pushing)(5.0)
            assert str(e.value) == "trainer rank 0: WeightSyncError: engine0 is gone mid-push"
            return await pusher([conn], 5, [], None)(5.0)

        [answer] = await train([conn], 4, asyncio.ensure_future(update()), pushing)
        return answer["ended"]

    assert asyncio.run(main()) == [5]
    conn.send(("stop",))
    assert conn.recv() == ("ended", ["push", "train", "stop"], [5])  # hold ran push 5

    conn = pushing_rank(fail_version=3)  # an update that fails for good fails the step

    async def failing():
        pushing = asyncio.Event()
        update = asyncio.ensure_future(pusher([conn], 3, [], None, pushing)(5.0))
        with pytest.raises(RuntimeError, match="engine0 is gone mid-push"):
            await train([conn], 4, update, pushing)

    asyncio.run(failing())


def test_a_rank_held_for_an_update_stops_when_told(pushing_rank):
    from rlferry.rl._ranks import pusher

    conn = pushing_rank()

    async def main():
        pushing = asyncio.Event()
        push = asyncio.ensure_future(pusher([conn], 3, [], None, pushing)(5.0))
        await pushing.wait()
        conn.send(("train", 4, True))
        await push
        conn.send(("stop",))

    asyncio.run(main())
    assert conn.recv() == ("ended", ["push", "train", "stop"], [3])


def _rank_told_to_stop(conn, engine_pid):
    """Answers ``stop`` with whether the engine ``engine_pid`` was gone by then."""
    conn.send(("ready",))
    assert conn.recv() == ("stop",)
    conn.send(("ok", {"engine gone": not os.path.exists(f"/proc/{engine_pid}")}))


def test_the_run_stops_its_engines_before_its_ranks():
    """An engine reads the weights a rank exports (cuda_ipc) until it exits: a rank told to
    stop first would exit with its memory still opened elsewhere."""
    import subprocess
    import sys

    from rlferry.rl._processes import Processes

    procs = Processes()
    engine = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys; print('up', flush=True); signal.pause()"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert engine.stdout is not None and engine.stdout.readline() == "up\n"
    procs.add_engine(engine)
    parent, child = CTX.Pipe()
    trainer = CTX.Process(target=_rank_told_to_stop, args=(child, engine.pid), daemon=True)
    trainer.start()
    procs.trainers.append((trainer, parent))
    try:
        assert parent.poll(60) and parent.recv() == ("ready",)
        procs.stop()
        assert parent.poll(10), "the rank never answered the stop"
        assert parent.recv() == ("ok", {"engine gone": True})
        assert engine.returncode == -15 and trainer.exitcode == 0
    finally:
        engine.kill()
        trainer.kill()
        engine.wait(10)
        trainer.join(10)
        engine.stdout.close()
