"""The weight plane across processes: shm mapped by another process, receivers that die."""

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from rlferry.weights import PushTimeout, WeightReceiver, WeightSender, WeightSyncError
from rlferry.weights._line import Starter

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run


def _receive(address, group, name, conn, hang, hang_after=0):
    params = {}
    commits = []

    def load(items):
        if hang and len(commits) == hang_after:
            conn.send("loading")
            threading.Event().wait()  # killed here, mid-push
        for n, t in items:
            params[n] = t.clone()

    def on_commit(version):
        commits.append(version)
        conn.send(("commit", version, {n: float(t.double().sum()) for n, t in params.items()}))

    r = WeightReceiver(group=group, address=address, load=load, on_commit=on_commit, name=name)
    r.start(timeout=60)
    conn.send("ready")
    conn.recv()  # until told to stop
    r.close()


def spawn(address, group, name, hang=False, hang_after=0):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_receive, args=(address, group, name, child, hang, hang_after), daemon=True
    )
    proc.start()
    assert parent.poll(120), f"receiver {name} did not start"
    assert parent.recv() == "ready"
    return proc, parent


def sums(sd):
    return {n: float(t.double().sum()) for n, t in sd.items()}


def weights(seed):
    g = torch.Generator().manual_seed(seed)
    sd = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(6)}  # 6 MiB
    sd["b"] = torch.randn(3, generator=g).bfloat16()
    return sd


@pytest.mark.parametrize(("transport", "before"), [("shm", 0), ("broadcast", 0), ("broadcast", 2)])
def test_a_receiver_killed_mid_push_fails_the_push_by_name_and_the_next_reaches_the_others(
    transport, before
):
    # before: pushes that commit first (over broadcast the second and later pushes start
    # on the receivers' start lines, the killed one's included)
    s = WeightSender(group="g", transport=transport, receivers=2, bucket_bytes=1 << 20)
    ok, ok_conn = spawn(s.address, "g", "steady")
    dying, dying_conn = spawn(s.address, "g", "dying", hang=True, hang_after=before)
    sd = weights(0)
    for v in range(1, before + 1):
        assert s.push(sd.items(), version=v, timeout=60).receivers == ("steady", "dying")
        assert dying_conn.recv()[:2] == ("commit", v)
    assert s.statistics().started_on_lines == max(0, before - 1)
    v = before + 1
    result = {}

    def push():
        t0 = time.monotonic()
        try:
            s.push(sd.items(), version=v, timeout=60)
        except WeightSyncError as e:
            result["error"] = e
        result["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=push)
    t.start()
    assert dying_conn.poll(60) and dying_conn.recv() == "loading"
    killed = time.monotonic()
    os.kill(dying.pid, signal.SIGKILL)
    t.join(60)
    e = result["error"]
    assert "dying" in e.failures
    assert "disconnected (its process died or it closed its receiver)" in e.failures["dying"]
    assert time.monotonic() - killed < 20  # seen at once, not at the 60 s timeout
    if transport == "shm":  # the other one finished; over broadcast the stream broke for all
        assert list(e.failures) == ["dying"] and e.report.receivers == ("steady",)
    if transport == "broadcast" and before:
        assert s.statistics().started_on_lines == before  # the killed push started there
    sd2 = weights(1)
    report = s.push(sd2.items(), version=v + 1, timeout=60)
    assert report.receivers == ("steady",)
    while True:  # the steady one's commits, the last one is the push after the failed one
        msg = ok_conn.recv()
        if msg[1] == v + 1:
            break
    assert msg == ("commit", v + 1, sums(sd2))
    ok_conn.send("stop")
    ok.join(30)
    s.close()


def test_shm_buffers_are_mapped_by_another_process_and_the_values_arrive_exactly():
    s = WeightSender(group="g", transport="shm", receivers=1, bucket_bytes=1 << 20)
    proc, conn = spawn(s.address, "g", "child")
    for v in (1, 2):
        sd = weights(v)
        report = s.push(sd.items(), version=v, timeout=60)
        assert report.receivers == ("child",)
        assert conn.recv() == ("commit", v, sums(sd))
    conn.send("stop")
    proc.join(30)
    s.close()


def _writer(address, conn):
    def load(items):
        for _, t in items:
            t.add_(1)  # forbidden: the views are the trainer's own tensors

    r = WeightReceiver(group="g", address=address, load=load, name="writer").start(timeout=60)
    conn.send("ready")
    conn.recv()
    r.close()


def test_shm_zero_copy_views_are_read_only_a_load_that_writes_dies_and_the_trainer_is_intact():
    s = WeightSender(group="g", transport="shm", receivers=1, bucket_bytes=1 << 20)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_writer, args=(s.address, child), daemon=True)
    proc.start()
    assert conn.poll(120) and conn.recv() == "ready"
    sd = weights(0)
    before = sums(sd)
    with pytest.raises(WeightSyncError) as e:
        s.push(sd.items(), version=1, timeout=60)
    proc.join(30)
    assert proc.exitcode == -signal.SIGSEGV
    assert list(e.value.failures) == ["writer"] and sums(sd) == before
    s.close()


def test_a_push_ends_on_its_receivers_word_on_the_commit_line_and_no_other_process_says_it():
    s = WeightSender(group="c", transport="shm")
    proc, conn = spawn(s.address, "c", "one", hang=True, hang_after=1)
    try:
        sd = weights(0)
        assert s.push(sd.items(), version=1, timeout=60).receivers == ("one",)
        assert conn.recv() == ("commit", 1, sums(sd))
        assert s.statistics().commits_on_line == 1  # it ended there, not on the acknowledgement
        # the receiver hangs in push 2's load: a word in its name from another process (this
        # one: the test knows its key and the line) is not taken as its commit
        (key,) = s._hub.members
        line = s._hub.commits.name
        result = {}

        def push():
            try:
                s.push(sd.items(), version=2, timeout=3)
            except WeightSyncError as e:
                result["error"] = e

        t = threading.Thread(target=push)
        t.start()
        assert conn.poll(60) and conn.recv() == "loading"
        forger = Starter()
        forger.committed(line, 2, key)
        forger.close()
        t.join(60)
        e = result["error"]
        assert isinstance(e, PushTimeout) and list(e.failures) == ["one"]
        assert s.statistics().commits_on_line == 1
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        s.close()
