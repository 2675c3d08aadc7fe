"""How a model's bytes can cross from one GPU to another: by how many operations, and by
NCCL or by the copy engines.

Two processes, GPU 0 (a trainer's tensors) and GPU 1 (an engine's), the tensors of
``--model`` at ``--scale`` (bf16; Qwen3-8B at scale 2: 399 tensors, 4.1 GB):

- NCCL (a two-rank group, as a point-to-point link forms it): one send of one buffer of
  every byte; a send of each 256 MiB of that buffer; a send per tensor, coalesced into
  one NCCL launch per group of tensors (every tensor, 256 MiB, 64 MiB) or not coalesced.
- The copy engines (CUDA IPC: GPU 0's tensors opened in the engine process, which copies
  them with ``copy_``): one buffer, a ``copy_`` per tensor, one ``_foreach_copy_``.

p50 and max ms of ``--repeat`` after two warm-ups, GB/s, and the CPU time that enqueued
the operations (NCCL). The record behind two choices: a link sends packed buckets (a
send per tensor took as long or longer, and its launches cost 7-16 us of Python each),
and over NCCL (a copy per tensor took the copy engines 1.2-1.7x one buffer's time; one
buffer's copy was 4-6% faster than NCCL's send). rlferry's own code moves nothing here.

    python benchmarks/link_ops.py [--scale 2] [--repeat 10]
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _weights_engine as eng
from _common import receive, start_worker, table


def _times(
    fn: Callable[[], Any], dev: torch.device, repeat: int, before: Callable[[], Any]
) -> tuple[float, float, float]:
    """p50 and max ms of ``fn`` to the device's end, and p50 ms of its CPU part."""
    total, cpu = [], []
    for i in range(repeat + 2):
        before()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize(dev)
        if i >= 2:
            total.append(time.perf_counter() - t0)
            cpu.append(t1 - t0)
    return statistics.median(total) * 1e3, max(total) * 1e3, statistics.median(cpu) * 1e3


def _nccl(rank: int, port: int, args: argparse.Namespace, out: Connection) -> None:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    o = dist.ProcessGroupNCCL.Options()
    o._timeout = datetime.timedelta(seconds=60)
    o.is_high_priority_stream = True
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("ops", store), rank, 2, o)
    ts = [torch.empty(s, dtype=torch.bfloat16, device=dev)
          for _, s in eng.model_shapes(args.model, args.scale)]  # fmt: skip
    total = sum(t.numel() * t.element_size() for t in ts)
    flat = torch.empty(total, dtype=torch.uint8, device=dev)
    one = torch.zeros(8, dtype=torch.uint8, device=dev)

    def op(t: torch.Tensor) -> Any:
        return pg.send([t], 1, 0) if rank == 0 else pg.recv([t], 0, 0)

    def grouped(limit: int) -> None:
        group: list[torch.Tensor] = []
        n = 0
        for i, t in enumerate(ts):
            group.append(t)
            n += t.numel() * t.element_size()
            if n >= limit or i + 1 == len(ts):
                pg._start_coalescing()
                for g in group:
                    op(g)
                pg._end_coalescing()
                group, n = [], 0

    step = 256 << 20
    cases: dict[str, Callable[[], Any]] = {
        "NCCL, one send of one buffer": lambda: op(flat),
        "NCCL, a send per 256 MiB of it": lambda: [
            op(flat[i : i + step]) for i in range(0, total, step)
        ],
        "NCCL, a send per tensor, one launch": lambda: grouped(1 << 62),
        "NCCL, a send per tensor, a launch per 256 MiB": lambda: grouped(256 << 20),
        "NCCL, a send per tensor, a launch per 64 MiB": lambda: grouped(64 << 20),
        "NCCL, a send per tensor, not coalesced": lambda: [op(t) for t in ts],
    }
    rows = []
    for name, fn in cases.items():
        p50, mx, cpu = _times(fn, dev, args.repeat, lambda: op(one).wait())
        rows.append((name, p50, mx, cpu))
    out.send((total, len(ts), rows))
    pg.abort()


def _owner(args: argparse.Namespace, peer: Connection, out: Connection) -> None:
    torch.cuda.set_device(0)
    ts = [torch.randn(s, device="cuda:0").to(torch.bfloat16)
          for _, s in eng.model_shapes(args.model, args.scale)]  # fmt: skip
    flat = torch.empty(sum(t.numel() for t in ts), dtype=torch.bfloat16, device="cuda:0")
    torch.cuda.synchronize()
    peer.send((ts, flat))  # CUDA IPC: the copying process opens them where they lie
    out.recv()  # they live until the parent says the copies are done


def _copier(args: argparse.Namespace, peer: Connection, out: Connection) -> None:
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(dev)
    ts, flat = receive(peer, "the trainer's tensors")
    params = [torch.empty(t.shape, dtype=t.dtype, device=dev) for t in ts]
    pflat = torch.empty(flat.shape, dtype=flat.dtype, device=dev)
    stream = torch.cuda.Stream(dev)

    def on_stream(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            with torch.cuda.stream(stream):
                fn()
            stream.synchronize()

        return run

    cases = {
        "copy engines, one copy of one buffer": on_stream(lambda: pflat.copy_(flat)),
        "copy engines, a copy_ per tensor": on_stream(
            lambda: [p.copy_(t, non_blocking=True) for p, t in zip(params, ts, strict=True)]
        ),
        "copy engines, one _foreach_copy_": on_stream(lambda: torch._foreach_copy_(params, ts)),
    }
    rows = []
    for name, fn in cases.items():
        p50, mx, _ = _times(fn, dev, args.repeat, lambda: None)
        rows.append((name, p50, mx, float("nan")))
    same = all(torch.equal(p, t.to(dev)) for p, t in zip(params, ts, strict=True))
    out.send((rows, same))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b", help="qwen3-8b or qwen3-30b-a3b")
    p.add_argument("--scale", type=int, default=2, help="divide every width (2: 4.1 GB)")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"expected 2 GPUs or more, got {torch.cuda.device_count()}")
    eng.model_shapes(args.model, args.scale)  # a wrong --model fails here, not in a worker
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [start_worker(ctx, _nccl, r, port, args) for r in range(2)]
    total, count, nccl = [receive(c, "NCCL's times") for _, c in ranks][1]  # the receiver's
    a, b = ctx.Pipe()
    _, owner = start_worker(ctx, _owner, args, a)
    _, copier = start_worker(ctx, _copier, args, b)
    a.close()
    b.close()
    copies, same = receive(copier, "the copies' times")
    owner.send("done")
    rows = []
    for name, p50, mx, cpu in nccl + copies:
        enqueue = "" if cpu != cpu else f"{cpu:.2f}"  # NaN: the copies' CPU time is not told
        rows.append([name, f"{p50:.2f}", f"{mx:.2f}", f"{total / p50 / 1e6:.0f}", enqueue])
    print(f"{args.model} / {args.scale}: {count} tensors, {total / 1e9:.2f} GB bf16, "
          f"{torch.cuda.get_device_name(0)}; the copies exact: {same}")  # fmt: skip
    print(table(rows, ["how", "p50 ms", "max ms", "GB/s", "CPU ms (enqueue)"]))


if __name__ == "__main__":
    main()
