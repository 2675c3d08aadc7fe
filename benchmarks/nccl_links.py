"""NCCL's own cost of a point-to-point link: device memory and bandwidth of two-rank groups.

Two processes (GPUs 0 and 1) form K two-rank NCCL groups side by side, each taking at most
``max_ctas`` thread blocks (0: NCCL's own choice), and send their share of ``--gib`` GiB
at once (one send a group, its own buffer). Prints, for each (K, blocks), the device
memory a group took outside torch's allocator and the bytes moved per second, p50 of
``--repeat`` sends after two warm-ups. This is the baseline ``link_ctas`` (rlferry's
thread blocks for a point-to-point link) was chosen from; nothing of rlferry runs.

    python benchmarks/nccl_links.py [--gib 2] [--repeat 10]
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import receive, start_worker, table

CASES = [(1, 0), (1, 16), (2, 0), (2, 16), (4, 0), (4, 8), (8, 4), (16, 4), (16, 2)]


def _group(store: Any, prefix: str, rank: int, ctas: int) -> Any:
    o = dist.ProcessGroupNCCL.Options()
    o._timeout = datetime.timedelta(seconds=60)
    o.is_high_priority_stream = True
    if ctas:
        o.config.max_ctas = ctas
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, 2, o)


def _worker(rank: int, port: int, args: argparse.Namespace, out: Connection) -> None:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    total = int(args.gib * 2**30)
    one = torch.zeros(8, dtype=torch.uint8, device=dev)
    rows = []
    for links, ctas in CASES:
        torch.cuda.synchronize(dev)
        free, reserved = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)
        groups = [_group(store, f"{links}/{ctas}/{k}", rank, ctas) for k in range(links)]
        bufs = [torch.empty(total // links, dtype=torch.uint8, device=dev) for _ in groups]
        for g in groups:  # connect each group's peers (NCCL allocates lazily)
            (g.send if rank == 0 else g.recv)([one], 1 - rank, 0).wait()
        torch.cuda.synchronize(dev)
        taken = (free - torch.cuda.mem_get_info(dev)[0]) - (
            torch.cuda.memory_reserved(dev) - reserved
        )
        times = []
        for _ in range(args.repeat + 2):
            (groups[0].send if rank == 0 else groups[0].recv)([one], 1 - rank, 0).wait()
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            works = [
                (g.send if rank == 0 else g.recv)([b], 1 - rank, 0)
                for g, b in zip(groups, bufs, strict=True)
            ]
            for w in works:
                w.wait()
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
        p50 = statistics.median(times[2:])
        rows.append([
            str(links), str(ctas or "NCCL's own"), f"{taken / links / 2**20:.0f}",
            f"{p50 * 1e3:.2f}", f"{total / p50 / 1e9:.0f}",
        ])  # fmt: skip
        for g in groups:
            g.abort()
        del groups, bufs
        torch.cuda.synchronize(dev)
    out.send(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="bytes sent, all groups together")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"expected 2 GPUs or more, got {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    workers = [start_worker(ctx, _worker, r, port, args) for r in range(2)]
    got = [receive(conn, f"rank {r}'s rows") for r, (_, conn) in enumerate(workers)]
    rows = got[0]  # the sending rank's
    for proc, _ in workers:
        proc.join(60)
    header = ["groups side by side", "thread blocks", "MiB a group", "p50 ms", "GB/s"]
    print(table(rows, header))


if __name__ == "__main__":
    main()
