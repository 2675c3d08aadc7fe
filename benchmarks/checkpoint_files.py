"""What rlferry's checked file format costs against writing the same bytes raw.

A dict of bf16 tensors (``--gbytes`` in all, 16 tensors) is written three ways in one run,
to ``--dir``: the bytes alone (open, write, fsync: the floor of any checkpoint file),
``rlferry.wire.files.write_file`` (sizes, sha256 hashed on a second thread while the frames
are written, temporary name, fsync, rename) and read back with ``read_file`` (length and
checksum checked). The sha256 of the same bytes alone is timed too. Every figure is GB/s of
the tensors' bytes, best of ``--repeat``; the ratios are against the raw write.

    python benchmarks/checkpoint_files.py --gbytes 1 --dir /tmp
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

import torch

from rlferry.wire.files import read_file, write_file
from rlferry.wire.lowlevel import tensor_buffer

from _common import gbps, table


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gbytes", type=float, default=1.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    n = int(args.gbytes * 1e9) // 2 // 16
    value = {f"w{i}": torch.randn(n).to(torch.bfloat16) for i in range(16)}
    nbytes = sum(t.nbytes for t in value.values())
    views = [tensor_buffer(t) for t in value.values()]
    raw, checked = Path(args.dir) / "raw.bin", Path(args.dir) / "checked.rlf"

    def write_raw() -> None:
        with open(raw, "wb") as f:
            for v in views:
                f.write(v)
            f.flush()
            os.fsync(f.fileno())

    def sha256() -> None:
        h = hashlib.sha256()
        for v in views:
            h.update(v)

    try:
        t_raw = _best(write_raw, args.repeat)
        t_hash = _best(sha256, args.repeat)
        t_write = _best(lambda: write_file(checked, value), args.repeat)
        t_read = _best(lambda: read_file(checked), args.repeat)
    finally:
        raw.unlink(missing_ok=True)
        checked.unlink(missing_ok=True)
    rows = [
        ("raw write + fsync", f"{gbps(nbytes, t_raw):.2f}", "1.00"),
        ("sha256 alone", f"{gbps(nbytes, t_hash):.2f}", f"{t_hash / t_raw:.2f}"),
        ("write_file (checked)", f"{gbps(nbytes, t_write):.2f}", f"{t_write / t_raw:.2f}"),
        ("read_file (checked)", f"{gbps(nbytes, t_read):.2f}", f"{t_read / t_raw:.2f}"),
    ]
    print(f"{nbytes / 1e9:.2f} GB of bf16 tensors in {args.dir}")
    print(table(rows, ("what", "GB/s", "time / raw write")))


if __name__ == "__main__":
    main()
