"""The sender's diff of a delta push, alone: how fast it finds what changed, by device.

A bf16 state dict with Qwen3-8B's names and shapes (``--scale N`` divides every width) is
kept as the base, and a new version made from it with ``--changed`` of its elements moved
by one step of their last bit (a bf16 weight that a small optimizer step moved). Timed:
the diff of the new version against the base (``rlferry.weights.delta``'s encoding, the
base updated in place), against a copy of the same bytes on the same device in the same
run (what a full push reads and writes at least once). The diff's GB/s is of the pushed
bytes: ``rlferry plan-weights --diff-gbytes`` takes it.

    python benchmarks/delta_diff.py --device cuda --changed 0.01,0.04,0.25
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlferry.weights.delta._base import KeptBase

from _weights_engine import model_shapes


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=int, default=None, help="divide every width (CPU: 4)")
    p.add_argument("--changed", default="0.01,0.04,0.25", help="fractions, comma-separated")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    scale = a.scale or (1 if a.device == "cuda" else 4)
    g = torch.Generator(device=a.device).manual_seed(0)
    state = [
        (n, torch.empty(s, dtype=torch.bfloat16, device=a.device).normal_(0, 0.02, generator=g))
        for n, s in model_shapes("qwen3-8b", scale)
    ]
    total = sum(t.numel() * 2 for _, t in state)
    copies = [torch.empty_like(t) for _, t in state]

    def copy() -> None:
        for dst, (_, src) in zip(copies, state, strict=True):
            dst.copy_(src)

    base_ms = statistics.median(_time(copy, a.device, a.repeat)) * 1e3
    print(f"qwen3-8b / {scale}: {len(state)} tensors, {total / 1e9:.2f} GB bf16 on {a.device}")
    print("| changed | diff ms p50 / p90 / max | diff GB/s | sent / dense | copy ms | x copy |")
    print("|---|---|---|---|---|---|")
    for frac in (float(x) for x in a.changed.split(",")):
        kept = KeptBase(budget=total, where="device")
        kept.refresh(state, version=0)
        times, sent = [], 0
        for v in range(1, a.repeat + 1):
            new = []
            for n, t in state:  # frac of the elements one bit apart from the base
                step = torch.rand(t.shape, generator=g, device=a.device) < frac
                new.append((n, (t.view(torch.int16) ^ step.to(torch.int16)).view(t.dtype)))
            _sync(a.device)
            t0 = time.perf_counter()
            encoded = kept.encode(new, version=v)
            _sync(a.device)
            times.append(time.perf_counter() - t0)
            sent = encoded.sent
            state = new
        ms = sorted(x * 1e3 for x in times)
        p50, p90 = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
        print(
            f"| {frac:.2%} | {p50:.1f} / {p90:.1f} / {ms[-1]:.1f} | {total / p50 / 1e6:.0f} | "
            f"{sent / total:.2%} | {base_ms:.1f} | {p50 / base_ms:.2f} |"
        )


if __name__ == "__main__":
    main()
