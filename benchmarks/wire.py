"""Wire benchmark: encode + send + receive + decode between two processes.

The payload is TransferQueue's perftest "small" batch: 1024 samples x 9 fields
x 8192 float32 (about 0.28 GiB). One process sends it to a server in another
process, which decodes it (views over the received frames) and answers with
the byte count; the time is the round trip, over tcp:// loopback and ipc://.
The baseline, in the same run: one memcpy of the same bytes.

``--ragged``: a rollout put's columns instead (``--samples`` rows x 4 lists of 1-d
tensors of 5-16 tokens, the demo's shape), encoded and decoded in this process: one
packed copy and one split (rlferry) against a copy and a view a row (the baseline);
p50/p90/max.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import platform
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from rlferry.wire import Client, Server, decode, default_address, encode

from _common import best_and_median, gbps, memcpy_seconds, table


def make_batch(samples: int, fields: int, seq_len: int) -> dict[str, torch.Tensor]:
    return {f"field_{i}": torch.randn(samples, seq_len) for i in range(fields)}


def nbytes_of(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes_of(v) for v in value.values())
    return 0


def _serve(transport: str, conn: Connection) -> None:
    async def handler(value: Any, peer: bytes) -> int:
        return nbytes_of(value)

    async def main() -> None:
        server = Server(handler, default_address(transport))
        conn.send(await server.start())
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        await server.aclose()

    asyncio.run(main())


def run(samples: int = 1024, fields: int = 9, seq_len: int = 8192, repeat: int = 5) -> str:
    torch.manual_seed(0)
    batch = make_batch(samples, fields, seq_len)
    nbytes = nbytes_of(batch)
    base = memcpy_seconds(nbytes, repeat)
    rows = [("memcpy (baseline)", f"{base * 1e3:.1f}", f"{gbps(nbytes, base):.2f}", "1.00")]
    ctx = mp.get_context("spawn")
    for transport in ("tcp", "ipc"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(transport, child), daemon=True)
        proc.start()
        if not parent.poll(60):
            proc.kill()
            raise RuntimeError(f"the {transport} server process did not start within 60 s")
        address = parent.recv()
        with Client(address) as client:

            def once() -> None:
                assert client.request(batch, timeout=120) == nbytes

            med = best_and_median(once, repeat)[1]
        parent.send("stop")
        proc.join(10)
        rows.append(
            (
                f"rlferry wire, {transport}://",
                f"{med * 1e3:.1f}",
                f"{gbps(nbytes, med):.2f}",
                f"{base / med:.2f}",
            )
        )
    head = (
        f"{samples} x {fields} fields x {seq_len} float32 = {nbytes / 2**30:.2f} GiB; "
        f"median of {repeat}; {platform.node()}, {torch.get_num_threads()} threads, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    return head + "\n\n" + table(rows, ("path", "ms", "GB/s", "x memcpy"))


def ragged(samples: int, repeat: int) -> str:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 17, (4, samples), generator=g).tolist()
    data = {
        f"col{c}": list(torch.randint(0, 100, (sum(ls),), generator=g).split(ls))
        for c, ls in enumerate(lengths)
    }

    def rlferry() -> None:
        decode(encode(data))

    def per_row() -> None:  # the baseline: a copy into the packed frame, a view out, a row
        for col in data.values():
            flat = [t.detach().resolve_conj().resolve_neg().reshape(-1).to("cpu")
                    .view(torch.uint8) for t in col]  # fmt: skip
            whole, at, out = torch.cat(flat), 0, []
            for t in col:
                size = t.numel() * t.element_size()
                out.append(whole[at : at + size].view(t.dtype).reshape(t.shape))
                at += size

    rows = []
    times: dict[str, list[float]] = {}
    for name, fn in (("rlferry: one copy, one split", rlferry),
                     ("a copy and a view a row (baseline)", per_row)):  # fmt: skip
        fn()
        times[name] = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        q = statistics.quantiles(times[name], n=10, method="inclusive")
        ms = (statistics.median(times[name]), q[8], max(times[name]))
        rows.append((name, *(f"{x * 1e3:.3f}" for x in ms)))
    ratio = statistics.median(times[rows[1][0]]) / statistics.median(times[rows[0][0]])
    head = (
        f"{samples} rows x 4 ragged int64 columns, encode + decode in one process; "
        f"{repeat} runs, baseline / rlferry p50 {ratio:.1f}x; {platform.node()}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    return head + "\n\n" + table(rows, ("path", "p50 ms", "p90", "max"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/wire.py", description=__doc__)
    p.add_argument("--samples", type=int, default=None, help="default 1024; 128 with --ragged")
    p.add_argument("--fields", type=int, default=9)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--ragged", action="store_true", help="a rollout put's ragged columns")
    a = p.parse_args(argv)
    if a.ragged:
        print(ragged(a.samples or 128, max(a.repeat, 50)))
    else:
        print(run(a.samples or 1024, a.fields, a.seq_len, a.repeat))


if __name__ == "__main__":
    main()
