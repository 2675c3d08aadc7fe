"""Tune the CUDA diff kernels: each pass alone over Qwen3-8B's shapes, per tile and warps."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from rlferry.weights.delta import _device_diff as E
from rlferry.weights.delta import _diff_kernel as K

sys.path.insert(0, "benchmarks")
from _common import device_ms
from _weights_engine import model_shapes


def main() -> None:
    dev = torch.device("cuda")
    shapes = model_shapes("qwen3-8b", 1)
    news = [torch.randn(s, dtype=torch.bfloat16, device=dev) for _, s in shapes]
    bases = []
    for t in news:
        b = t.clone()
        flat = b.view(-1).view(torch.int16)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), device=dev)
        flat[idx] ^= 1
        bases.append(b)
    total = sum(t.numel() * 2 for t in news)
    copy = device_ms(lambda: [b.copy_(t) for b, t in zip(bases, news, strict=False)])
    print(f"{len(news)} tensors, {total / 1e9:.2f} GB; copy {copy:.1f} ms")
    # restore the 1% difference after the copy
    for b in bases:
        flat = b.view(-1).view(torch.int16)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), device=dev)
        flat[idx] ^= 1
    rows, blocks = [], 0
    for a, b in zip(news, bases, strict=False):
        ai, bi = a.view(-1).view(torch.int16), b.view(-1).view(torch.int16)
        rows.append([ai.data_ptr(), bi.data_ptr(), ai.numel(), blocks, 0, 0, 0, 2])
        blocks += -(-ai.numel() // 256)
    counts = torch.empty(blocks, dtype=torch.int32, device=dev)
    for tile, warps, chunk in [
        (16, 8, 1 << 20),
        (1, 1, 1 << 19),
        (1, 1, 1 << 20),
        (1, 1, 1 << 22),
        (2, 1, 1 << 20),
        (1, 2, 1 << 20),
        (2, 2, 1 << 20),
    ]:
        K.CHUNK = chunk
        shape = (tile, warps)
        c = device_ms(lambda shape=shape: E._launch(K.count_blocks, rows, counts, dev, shape))
        starts = torch.zeros(blocks + 1, dtype=torch.int64, device=dev)
        torch.cumsum(counts, 0, out=starts[1:])
        sparse = []
        recs = []
        for r in rows:
            n = int(starts[r[3] + -(-r[2] // 256)] - starts[r[3]])
            _, va, oa, nb = E.layout(r[2], n, 2)
            d = torch.empty(nb, dtype=torch.uint8, device=dev)
            recs.append(d)
            # write into a scratch base so the diff stays (the base is not the real one)
            sparse.append([r[0], r[1], r[2], r[3], d.data_ptr(), va, oa, 2])
        # the write pass writes changes into the base: the next run finds none; keep a copy
        saved = [b.clone() for b in bases]

        def write(sparse=sparse, starts=starts, shape=shape):
            E._launch(K.write_records, sparse, starts, dev, shape)

        t0 = []
        for _ in range(5):
            for b, s in zip(bases, saved, strict=False):
                b.copy_(s)
            torch.cuda.synchronize()
            t = time.perf_counter()
            write()
            torch.cuda.synchronize()
            t0.append((time.perf_counter() - t) * 1e3)
        w = statistics.median(t0[1:])
        print(f"tile {tile:2d} warps {warps} chunk {chunk}: count {c:6.1f} ms, write {w:6.1f} ms")
        del saved, recs


if __name__ == "__main__":
    main()
