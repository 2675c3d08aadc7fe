"""The queue through Ray actors against the embedded queue: the same workload, the same run.

One client in this process puts a batch (``--rows`` samples of ``--fields`` float32
fields of ``--seq-len``), gets it whole and acks it, ``--iterations`` times per queue;
the two queues take turns (embedded, Ray, embedded, Ray, ...) so that drift on a shared
machine hits both alike. Embedded: ``Queue(storage_units=2)`` in this process. On
Ray: ``RayQueue.start(storage_units=2)`` on a local Ray, the client from
``rlferry.ray.queue(job)`` (same node: ipc://, shared memory, as embedded). For
reference, the same services as plain processes (``rlferry serve queue``), no Ray.

``--clients actors`` measures throughput as a job sees it: the clients are Ray actors
(``--pairs`` producers and as many consumers, each its own process), and the embedded
queue lives in this driver, reached by address, as a trainer process reaches a queue its
driver embeds. Each producer puts ``--iterations`` batches; its consumer gets each one
whole as it lands (a parked get) and acks it. Throughput: the bytes put and got over the
time from the first actor's start to the last one's end; the two queues take turns,
``--repeats`` runs each.

    python benchmarks/ray_queue.py [--iterations 20] [--rows 1024] [--fields 9] [--seq-len 1024]
    python benchmarks/ray_queue.py --clients actors [--pairs 1] [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import ray
import torch

from rlferry.queue import Queue
from rlferry.ray import RayQueue

from _common import gbps, table


@contextlib.contextmanager
def _served() -> Iterator[Queue]:
    """``rlferry serve queue`` (the controller and 2 storage unit processes, no Ray)."""
    cmd = [sys.executable, "-m", "rlferry.cli", "serve", "queue", "--storage-units", "2",
           "--tasks", "train"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # `controller ADDRESS` once it serves
        if not line.startswith("controller "):
            raise RuntimeError(f"rlferry serve queue did not start: {line!r}")
        with Queue.connect(line.split()[1]) as q:
            yield q
    finally:
        proc.terminate()
        proc.wait(30)


def _round(client: Any, data: dict[str, torch.Tensor], names: list[str], it: int,
           rows: int) -> tuple[float, float]:  # fmt: skip
    t0 = time.perf_counter()
    client.put(f"train_{it}", data, timeout=120)
    t1 = time.perf_counter()
    batch = client.get(f"train_{it}", task="train", batch_size=rows, fields=names, timeout=120)
    t2 = time.perf_counter()
    client.ack(batch)
    del batch
    return t1 - t0, t2 - t1


def _stats(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[int(0.9 * (len(xs) - 1))], xs[-1]


def run(iterations: int, rows: int, fields: int, seq_len: int) -> str:
    data = {f"field_{i}": torch.randn(rows, seq_len) for i in range(fields)}
    names = list(data)
    nbytes = sum(t.numel() * t.element_size() for t in data.values())
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    kinds = ("embedded", "processes", "ray")
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in kinds}
    try:
        with Queue(storage_units=2, tasks=("train",)) as emb, _served() as served, \
                RayQueue.start("bench", storage_units=2, cpus_per_unit=1) as rq:  # fmt: skip
            clients = {"embedded": emb.client(), "processes": served.client(),
                       "ray": rq.client()}  # fmt: skip
            for c in clients.values():  # warm: pools filled, connections made
                for it in range(3):
                    _round(c, data, names, -1 - it, rows)
            for it in range(iterations):
                for name, c in clients.items():
                    put, get = _round(c, data, names, it, rows)
                    times[name][0].append(put)
                    times[name][1].append(get)
    finally:
        ray.shutdown()
    rows_out = []
    for op, k in (("put", 0), ("get", 1)):
        emb_p50 = _stats(times["embedded"][k])[0]
        for name in kinds:
            p50, p90, mx = _stats(times[name][k])
            rows_out.append([
                op, name, f"{1e3 * p50:.2f}", f"{1e3 * p90:.2f}", f"{1e3 * mx:.2f}",
                f"{gbps(nbytes, p50):.2f}", f"{emb_p50 / p50:.3f}x",
            ])  # fmt: skip
    head = (f"{platform.node()}, {torch.get_num_threads()} threads, ray {ray.__version__}: "
            f"{rows} x {fields} x {seq_len} float32 ({nbytes / 1e6:.1f} MB) per batch, "
            f"{iterations} rounds each, taking turns")  # fmt: skip
    header = ["op", "queue", "p50 ms", "p90 ms", "max ms", "GB/s at p50", "vs embedded (p50)"]
    return head + "\n\n" + table(rows_out, header)


class _Client:
    """A producer or a consumer in a process of its own (a Ray actor)."""

    def __init__(self, role: str, rows: int, fields: int, seq_len: int) -> None:
        torch.set_num_threads(1)
        self.role = role
        self.data = {f"field_{i}": torch.randn(rows, seq_len) for i in range(fields)}
        self.rows = rows
        self.clients: dict[str, Any] = {}  # kept between runs: steady state, pools warm

    def run(self, where: str, tag: str, iterations: int) -> tuple[float, float, list[float]]:
        """Put or get ``iterations`` batches; (start, end, each op's seconds)."""
        if where not in self.clients:
            if where.startswith("ipc://"):  # the driver's embedded queue, by its address
                self.clients[where] = Queue.connect(where).client()
            else:  # the queue of a Ray job, by its name
                import rlferry.ray

                self.clients[where] = rlferry.ray.queue(where)
        client = self.clients[where]
        names = list(self.data)
        ops = []
        start = time.time()
        for it in range(iterations):
            t = time.perf_counter()
            if self.role == "producer":
                client.put(f"{tag}_{it}", self.data, timeout=120)
            else:
                batch = client.get(f"{tag}_{it}", task="train", batch_size=self.rows,
                                   fields=names, timeout=120)  # fmt: skip
                client.ack(batch)
                del batch
            ops.append(time.perf_counter() - t)
        return start, time.time(), ops


def run_actors(iterations: int, rows: int, fields: int, seq_len: int, pairs: int,
               repeats: int, units: int) -> str:  # fmt: skip
    nbytes = rows * fields * seq_len * 4
    ray.init(num_cpus=4 * pairs + 4, include_dashboard=False, log_to_driver=False)
    actor = ray.remote(num_cpus=1)(_Client)
    wall: dict[str, list[float]] = {"embedded": [], "ray": []}
    ops: dict[tuple[str, str], list[float]] = {}
    try:
        with Queue(storage_units=units, tasks=("train",)) as emb, \
                RayQueue.start("bench", storage_units=units, cpus_per_unit=1):  # fmt: skip
            roles = ["producer", "consumer"] * pairs
            clients = [actor.remote(r, rows, fields, seq_len) for r in roles]
            where = {"embedded": emb.address, "ray": "bench"}
            for n in range(repeats + 1):  # the first round of each warms up
                for kind in ("embedded", "ray"):
                    tag = f"{kind}{n}"
                    out = ray.get([c.run.remote(where[kind], f"{tag}_{i // 2}", iterations)
                                   for i, c in enumerate(clients)], timeout=600)  # fmt: skip
                    if n == 0:
                        continue
                    wall[kind].append(max(e for _, e, _ in out) - min(s for s, _, _ in out))
                    for role, (_, _, times) in zip(roles, out, strict=True):
                        ops.setdefault((kind, role), []).extend(times)
    finally:
        ray.shutdown()
    moved = 2 * pairs * iterations * nbytes  # put and got
    emb_p50 = _stats(wall["embedded"])[0]
    rows_out = []
    for kind in ("embedded", "ray"):
        p50, p90, mx = _stats(wall[kind])
        put50 = _stats(ops[(kind, "producer")])[0]
        get50 = _stats(ops[(kind, "consumer")])[0]
        rows_out.append([
            kind, f"{gbps(moved, p50):.2f}", f"{gbps(moved, mx):.2f}", f"{1e3 * p50:.0f}",
            f"{1e3 * p90:.0f}", f"{1e3 * mx:.0f}", f"{1e3 * put50:.2f}", f"{1e3 * get50:.2f}",
            f"{emb_p50 / p50:.3f}x",
        ])  # fmt: skip
    head = (f"{platform.node()}, {os.cpu_count()} cpus, ray {ray.__version__}: {pairs} producer "
            f"and {pairs} consumer actor(s), {iterations} batches of {rows} x {fields} x "
            f"{seq_len} float32 ({nbytes / 1e6:.1f} MB) each, {units} storage units, "
            f"{repeats} runs per queue, taking turns")  # fmt: skip
    header = ["queue", "GB/s (p50 run)", "GB/s (slowest)", "run p50 ms", "p90 ms", "max ms",
              "put p50 ms", "get+ack p50 ms", "throughput vs embedded (p50)"]  # fmt: skip
    return head + "\n\n" + table(rows_out, header)


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/ray_queue.py", description=__doc__)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--fields", type=int, default=9)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument(
        "--clients",
        choices=["driver", "actors"],
        default="driver",
        help="driver: one client in this process; actors: clients as Ray actors",
    )
    p.add_argument("--pairs", type=int, default=1, help="actors: producer/consumer pairs")
    p.add_argument("--repeats", type=int, default=7, help="actors: runs per queue")
    p.add_argument("--units", type=int, default=2, help="actors: storage units of each queue")
    a = p.parse_args()
    if a.clients == "actors":
        print(run_actors(a.iterations, a.rows, a.fields, a.seq_len, a.pairs, a.repeats, a.units))
    else:
        print(run(a.iterations, a.rows, a.fields, a.seq_len))


if __name__ == "__main__":
    main()
