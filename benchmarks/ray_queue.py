"""The queue through Ray actors against the embedded queue: the same workload, the same run.

One client in this process puts a batch (``--rows`` samples of ``--fields`` float32
fields of ``--seq-len``), gets it whole and acks it, ``--iterations`` times per queue;
the two queues take turns (embedded, Ray, embedded, Ray, ...) so that drift on a shared
machine hits both alike. Embedded: ``Queue.start(storage_units=2)`` in this process. On
Ray: ``RayQueue.start(storage_units=2)`` on a local Ray, the client from
``rlferry.ray.queue(job)`` (same node: ipc://, shared memory, as embedded). For
reference, the same services as plain processes (``rlferry serve queue``), no Ray.

    python benchmarks/ray_queue.py [--iterations 20] [--rows 1024] [--fields 9] [--seq-len 1024]
"""

from __future__ import annotations

import argparse
import contextlib
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
        with Queue.start(storage_units=2, tasks=("train",)) as emb, _served() as served, \
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


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/ray_queue.py", description=__doc__)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--fields", type=int, default=9)
    p.add_argument("--seq-len", type=int, default=1024)
    a = p.parse_args()
    print(run(a.iterations, a.rows, a.fields, a.seq_len))


if __name__ == "__main__":
    main()
