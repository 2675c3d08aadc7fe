"""Block-FP8 quantize benchmark: a trainer's linear weights to float8_e4m3fn + scales.

The weights of Qwen3-8B's linear layers (252 tensors, 13.9 GB bf16; widths divided by
``--scale``), random values, on ``--device``; one pass over all of them as a
:class:`ShardedSender` quantizes a push: ``quantize_block_fp8`` through the Triton kernel
(CUDA) and through the torch ops, beside a device copy of the same bf16 bytes (read and
write: the memory's speed) and the floor (bf16 read once, values and scales written
once, at the copy's speed). Every way's values and scales are checked equal, bit for
bit. Prints a table; ``--json OUT`` writes its rows (``way``, ``ms_p50``,
``gbytes_per_s``: bf16 bytes quantized a second, ``identical``).

``rlferry plan-weights`` times a block-FP8 push's quantize pass from the kernel's
``gbytes_per_s``: ``python benchmarks/weights_fp8.py --device cuda``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from rlferry.weights.copies import quantize_block_fp8

import _weights_engine as eng
from _common import table


def linear_weights(scale: int, device: str) -> list[torch.Tensor]:
    shapes = [s for n, s in eng.model_shapes("qwen3-8b", scale) if n.endswith("_proj.weight")]
    g = torch.Generator(device=device).manual_seed(0)
    return [
        torch.empty(s, dtype=torch.bfloat16, device=device).normal_(generator=g) * 0.02
        for s in shapes
    ]


def timed(fn: Any, device: str, repeat: int) -> list[float]:
    """Seconds of each of ``repeat`` runs after one warm-up (CUDA: events)."""
    fn()
    out = []
    for _ in range(repeat):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            import time

            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=int, default=1, help="divide every width")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    ws = linear_weights(a.scale, a.device)
    nbytes = sum(w.nbytes for w in ws)
    out_bytes = sum(w.numel() + 4 * -(-w.shape[0] // 128) * -(-w.shape[1] // 128) for w in ws)
    ways: dict[str, Any] = {}
    if a.device == "cuda":
        ways["kernel"] = lambda: [quantize_block_fp8(w, kernel=True) for w in ws]
    ways["torch ops"] = lambda: [quantize_block_fp8(w, kernel=False) for w in ws]
    copies = [torch.empty_like(w) for w in ws]
    ways["bf16 copy"] = lambda: [c.copy_(w) for c, w in zip(copies, ws, strict=True)]
    first = None
    rows = []
    results = {}
    for way, fn in ways.items():
        secs = timed(fn, a.device, a.repeat)
        got = fn() if way != "bf16 copy" else None
        if got is not None:
            first = got if first is None else first
            same = all(
                torch.equal(x[0].view(torch.uint8), y[0].view(torch.uint8))
                and torch.equal(x[1], y[1])
                for x, y in zip(got, first, strict=True)
            )
        else:
            same = True
        med = statistics.median(secs)
        results[way] = med
        rows.append({"way": way, "ms_p50": med * 1e3, "gbytes_per_s": nbytes / med / 1e9,
                     "identical": same})  # fmt: skip
        del got
    copy_rate = 2 * nbytes / results["bf16 copy"]
    floor = (nbytes + out_bytes) / copy_rate
    rows.append({"way": "floor", "ms_p50": floor * 1e3, "gbytes_per_s": nbytes / floor / 1e9,
                 "identical": True})  # fmt: skip
    print(f"{len(ws)} tensors, {nbytes / 1e9:.2f} GB bf16 on {a.device}")
    print(table(
        [[r["way"], f"{r['ms_p50']:.2f}", f"{r['gbytes_per_s']:.0f}", str(r["identical"])]
         for r in rows],
        ["way", "ms (median)", "GB/s of bf16 quantized", "identical"],
    ))  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
