"""The queue across processes: dead consumers lose nothing, dead services make clients raise."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from rlferry.queue import GetTimeout, Queue, ServiceGone

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run


def _consume_and_hang(address, conn):
    c = Queue.connect(address).client()
    b = c.get("p", task="train", batch_size=2, fields=["x"], timeout=30)
    conn.send(b.indexes)
    conn.recv()  # killed here, mid-batch, before any ack


def test_consumer_killed_mid_batch_loses_nothing():
    with Queue(storage_units=2, tasks=("train",), lease_timeout=1.0) as q:
        c = q.client()
        c.put("p", {"x": torch.arange(4.0)})
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_consume_and_hang, args=(q.address, child), daemon=True)
        proc.start()
        assert parent.poll(60)
        taken = parent.recv()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        seen = []
        for _ in range(2):  # the other 2 now, the dead consumer's 2 once its lease expires
            b = c.get("p", task="train", batch_size=2, fields=["x"], timeout=10)
            seen += b.indexes
            c.ack(b)
        assert sorted(seen) == [0, 1, 2, 3] and set(taken) <= set(seen)
        assert c.statistics().samples_held == 0


def _serve(*extra: str) -> tuple[subprocess.Popen[str], str, list[int]]:
    cmd = [sys.executable, "-m", "rlferry.cli", "serve", "queue", "--storage-units", "2"]
    proc = subprocess.Popen([*cmd, "--tasks", "train", *extra], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    assert lines[0].startswith("controller ")
    return proc, lines[0].split()[1], [int(line.split()[3]) for line in lines[1:]]


@pytest.fixture
def served():
    proc, address, units = _serve()
    yield proc, address, units
    proc.terminate()
    proc.wait(20)


def test_served_over_tcp_with_a_secret_puts_and_gets():
    secret = "a shared secret of the whole job"
    proc, address, _ = _serve("--bind", "tcp://127.0.0.1:*", "--secret", secret)
    try:
        assert address.startswith("tcp://127.0.0.1:")
        with Queue.connect(address, secret=secret).client() as c:  # units publish over CURVE
            c.put("p", {"x": torch.arange(3.0), "s": ["a", "b", "c"]}, timeout=10)
            b = c.get("p", task="train", batch_size=3, fields=["x", "s"], timeout=10)
            assert b.data["x"].tolist() == [0.0, 1.0, 2.0] and b.data["s"] == ["a", "b", "c"]
    finally:
        proc.terminate()
        proc.wait(20)


def test_served_queue_puts_and_gets_across_processes(served):
    _, address, _ = served
    with Queue.connect(address).client() as c:
        idx = c.put("p", {"x": torch.randn(8, 1024), "s": list("abcdefgh")})
        b = c.get("p", task="train", batch_size=8, fields=["x", "s"], timeout=10)
        assert b.indexes == idx and b.data["s"] == list("abcdefgh")


def test_killed_storage_unit_makes_clients_raise_not_hang(served):
    _, address, units = served
    with Queue.connect(address).client() as c:
        c.put("p", {"x": torch.arange(4.0)})  # a put goes whole to the emptiest unit: unit 0
        os.kill(units[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ServiceGone):
            c.get("p", task="train", batch_size=4, fields=["x"], timeout=5)
        assert time.monotonic() - t0 < 30
        gone = threading.Event()
        for _ in range(200):  # the controller hears of the death from its socket monitor
            units_now = c.statistics().storage_units
            if [u.alive for u in units_now] == [False, True] and units_now[0].error is None:
                break
            gone.wait(0.05)  # allowed: a test waiting for an asynchronous report
        else:
            raise AssertionError("the controller never marked storage unit 0 gone")
        for name in ("q", "r", "s"):  # new puts go to the unit alive, and are read back
            c.put(name, {"x": torch.arange(4.0)}, timeout=5)
            b = c.get(name, task="train", batch_size=4, fields=["x"], timeout=5)
            assert b.data["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_killed_controller_wakes_a_waiting_get(served):
    proc, address, units = served
    with Queue.connect(address).client() as c:
        c.put("p", {"x": torch.arange(1.0)})
        from rlferry.wire import wire_loop

        fut = wire_loop().submit(
            c._client.get("p", task="train", batch_size=4, fields=["x"], timeout=60)
        )
        time.sleep(0.3)  # allowed: lets the get park at the controller
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(ServiceGone, match="disconnected"):
            fut.result(timeout=30)
    gone = threading.Event()
    for _ in range(200):  # its storage unit processes follow it
        if not any(_running(pid) for pid in units):
            break
        gone.wait(0.05)  # allowed: a test waiting for other processes to exit
    else:
        raise AssertionError("storage units outlived their killed server")


def _dist_rank(rank, address, store, conn):
    import torch.distributed as dist

    from rlferry.queue import get_broadcast

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    client = Queue.connect(address).client() if rank == 0 else None
    b = get_broadcast(client, "p", src=0, task="train", batch_size=3, fields=["x", "s"], timeout=30)
    conn.send([b.indexes, b.data["x"].tolist(), b.data["s"], b.meta])
    dist.destroy_process_group()


def test_get_broadcast_gives_every_rank_the_source_ranks_batch(tmp_path):
    store = str(tmp_path / "group")  # a file rendezvous: no port to race another process for
    with Queue(storage_units=1, tasks=("train",)) as q:
        q.client().put("p", {"x": torch.arange(3.0), "s": ["a", "b", "c"]}, meta={"g": [1, 2, 3]})
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(2)]
        procs = [
            ctx.Process(target=_dist_rank, args=(r, q.address, store, pipes[r][1]), daemon=True)
            for r in range(2)
        ]
        for p in procs:
            p.start()
        got = []
        for parent, _ in pipes:
            assert parent.poll(120)
            got.append(parent.recv())
        for p in procs:
            p.join(30)
        assert got[0] == got[1] == [[0, 1, 2], [0.0, 1.0, 2.0], ["a", "b", "c"], {"g": [1, 2, 3]}]


def test_get_timeout_on_a_served_queue(served):
    _, address, _ = served
    with Queue.connect(address).client() as c, pytest.raises(GetTimeout):
        c.get("nothing", task="train", batch_size=1, fields=["x"], timeout=0.3)
