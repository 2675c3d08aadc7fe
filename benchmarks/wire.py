"""Wire benchmark: encode + send + receive + decode between two processes.

The payload is TransferQueue's perftest "small" batch: 1024 samples x 9 fields
x 8192 float32 (about 0.28 GiB). One process sends it to a server in another
process, which decodes it (views over the received frames) and answers with
the byte count; the time is the round trip, over tcp:// loopback and ipc://.
The baseline, in the same run: one memcpy of the same bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import platform
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from rlferry.wire import Client, Server, default_address

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
        await server.close()

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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/wire.py", description=__doc__)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--fields", type=int, default=9)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    print(run(a.samples, a.fields, a.seq_len, a.repeat))


if __name__ == "__main__":
    main()
