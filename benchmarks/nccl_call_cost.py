"""What enqueuing one small NCCL collective costs the calling thread, on a link's group.

Two processes, GPU 0 and GPU 1, in a two-rank group made as a point-to-point link makes
it (``transports._groups.make_group``). Rank 1 times, ``--repeat`` times each, the
call that enqueues a 4-byte collective (rank 0, which only enqueues and waits, is
there first, as a sender is; each rank synchronizes its device after each call):

- ``broadcast``: what a link's bucket costs to enqueue (a bucket's is the same call);
- ``allreduce``: the MAX all-reduce a receiver says its outcome with;
- ``tell``: ``DistributedReceiver.tell`` as a receiver calls it (its stream, the fill, the
  all-reduce).

p50 / p90 / max microseconds of the call. The record behind the end of a push on the
group: on four H100s a receiver's ``tell`` took 100-220 us between its commit and its
ack. Run with ``TORCH_NCCL_TRACE_BUFFER_SIZE=0`` to see torch's flight recorder's share.

    python benchmarks/nccl_call_cost.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlferry.weights.transports import _groups
from rlferry.weights.transports._distributed_receiver import DistributedReceiver

from _common import receive, start_worker


def _worker(rank: int, port: int, repeat: int, conn: Connection) -> None:
    cuda = torch.cuda.is_available()  # without: gloo on the CPU (a dry run of the harness)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, use_libuv=True)
    pg = _groups.make_group("nccl" if cuda else "gloo", store, "cost", rank, 2, 60.0, None, True)
    rx = DistributedReceiver()
    rx._pg, rx._stream = pg, torch.cuda.Stream(dev) if cuda else None
    rx._outcome = torch.zeros(1, dtype=torch.int32, device=dev)
    t = torch.zeros(1, dtype=torch.int32, device=dev)
    ops = {
        "broadcast": lambda: pg.broadcast([t], _groups.broadcast_options()),
        "allreduce": lambda: pg.allreduce([t], _groups.max_options()),
        "tell": lambda: rx.tell(True),
    }
    out: dict[str, list[float]] = {}
    for name, op in ops.items():
        times = []
        for i in range(repeat + 10):
            if rank == 0:
                op()
            else:
                a = time.perf_counter_ns()
                op()
                b = time.perf_counter_ns()
                if i >= 10:  # after warm-ups
                    times.append((b - a) / 1e3)
            if cuda:
                torch.cuda.synchronize(dev)  # the collective ends once both ranks called it
            else:
                pg.broadcast([torch.zeros(1)], _groups.broadcast_options()).wait()  # gloo: in step
        out[name] = times
    conn.send(out if rank == 1 else None)
    _groups.abort(pg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [start_worker(ctx, _worker, r, port, args.repeat) for r in range(2)]
    res = [receive(c, f"rank {r}'s times") for r, (_, c) in enumerate(procs)][1]
    env = os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "(torch's default)")
    print(f"TORCH_NCCL_TRACE_BUFFER_SIZE={env}, torch {torch.__version__}")
    print("| call | p50 us | p90 us | max us |\n|---|---|---|---|")
    for name, ts in res.items():
        q = statistics.quantiles(ts, n=10)
        print(f"| {name} | {statistics.median(ts):.1f} | {q[-1]:.1f} | {max(ts):.1f} |")
    for p, _ in procs:
        p.join(30)


if __name__ == "__main__":
    main()
