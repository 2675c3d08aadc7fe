"""Tune the grouped copy's Triton kernel: one launch copying every tensor of a model's
shapes (bf16) into another set of the same shapes on one GPU, per grid (a program a tile,
or a bounded grid of programs looping over chunks), tile, warps and chunk size, against
a flat device copy of the same bytes and ``torch._foreach_copy_``.

    python benchmarks/_copy_tune.py --model qwen3-8b
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys

import torch

from rlferry.weights.copies import _copy as C
from rlferry.weights.copies import _copy_kernel as K

sys.path.insert(0, "benchmarks")
from _common import device_ms
from _weights_engine import model_shapes


def flat_copy_ms(nbytes: int, dev: torch.device, repeat: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_()
    b = torch.empty_like(a)
    return device_ms(lambda: b.copy_(a), repeat)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--pairs-only", action="store_true", help="no sweep of the kernel's settings")
    ap.add_argument("--warps", default="8", help="the pairings' kernel warps, comma-separated")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = model_shapes(args.model, 1)
    src = [torch.randn(s, dtype=torch.bfloat16, device=dev) for _, s in shapes]
    dst = [torch.empty_like(t) for t in src]
    nbytes = sum(t.numel() * t.element_size() for t in src)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{args.model}: {len(src)} tensors, {nbytes / 1e9:.2f} GB, {sms} SMs")

    flat = flat_copy_ms(nbytes, dev, args.repeat)
    print(f"flat copy: {flat:.2f} ms ({2 * nbytes / flat / 1e6:.0f} GB/s read + write)")
    fe = device_ms(lambda: torch._foreach_copy_(dst, src), args.repeat)
    print(f"_foreach_copy_: {fe:.2f} ms, {fe / flat:.2f}x flat")

    # the library's GroupedCopy on three pairings of the same tensors: into other tensors (a
    # push's), among the sources rotated within each shape (weights.py's in-process row),
    # each onto itself
    groups: dict[tuple[int, ...], list[torch.Tensor]] = collections.defaultdict(list)
    for t in src:
        groups[tuple(t.shape)].append(t)
    rot_d = [t for g in groups.values() for t in g]
    rot_s = [t for g in groups.values() for t in g[1:] + g[:1]]
    for warps in map(int, args.warps.split(",")):
        K._WARPS = warps
        for name, d, s in (("into other tensors", dst, src), ("rotated among the sources",
                           rot_d, rot_s), ("each onto itself", src, src)):  # fmt: skip
            ms = device_ms(C.GroupedCopy(d, s), args.repeat)
            print(f"GroupedCopy, {warps} warps, {name}: {ms:.2f} ms, {ms / flat:.2f}x flat")
    if args.pairs_only:
        return

    runs = [C.runs(d, s) for d, s in zip(dst, src, strict=True)]
    assert all(r is not None for r in runs)
    s_addr = torch.cat([r[0] for r in runs])  # type: ignore[index]
    d_addr = torch.cat([r[1] for r in runs])  # type: ignore[index]
    n = torch.cat([torch.full_like(r[0], r[2]) for r in runs])  # type: ignore[index]
    rows = []
    for chunk_kib, block, warps, grid in itertools.product(
        (256, 512, 1024, 4096), (1024, 2048, 4096, 8192), (4, 8, 16),
        (None, 1, 2, 4, 8, 16),
    ):  # fmt: skip
        chunk = chunk_kib * 1024
        if 4 * block > chunk:
            continue
        table = C.chunk_table(s_addr, d_addr, n, chunk).to(dev)
        K._WARPS = warps
        programs = None if grid is None else grid * sms
        for t in dst:
            t.zero_()
        launch = K.launcher(table, chunk // (4 * block), block, programs)
        torch.cuda.synchronize()
        ok = all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))
        p50 = device_ms(launch, args.repeat)
        rows.append((p50, chunk_kib, block, warps, grid, ok))
    rows.sort()
    print("| chunk KiB | block words | warps | programs / SM | p50 ms | x flat | equal |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    shown = rows[:25] + [r for r in rows[25:] if r[1] == 512 and r[4] in (None, 2)]
    for p50, chunk_kib, block, warps, grid, ok in shown:
        print(f"| {chunk_kib} | {block} | {warps} | {grid or 'a tile each'} | {p50:.2f} | "
              f"{p50 / flat:.2f} | {ok} |")  # fmt: skip
    now = [r for r in rows if r[1:5] == (512, 4096, 8, None)] + [
        r for r in rows if r[1:5] == (512, 4096, 8, 2)
    ]  # fmt: skip
    for p50, *_ in now:
        print(f"the library's settings: {p50:.2f} ms, {p50 / flat:.2f}x flat")


if __name__ == "__main__":
    main()
