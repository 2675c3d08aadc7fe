"""The Triton kernel of :func:`quantize_block_fp8`; imported only when it runs on CUDA.

One program a block: its elements read once (masked at the tensor's edges, any strides),
their amax, the scale, the values scaled and cast, both written; the arithmetic is the
torch ops' of ``_fp8`` to the bit (the reciprocal by ``div_rn``, the cast rounded to
nearest even).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["quantize_blocks"]


@triton.jit
def quantize_blocks(  # type: ignore[no-untyped-def]
    x, q, s, rows, cols, row_blocks, sx0, sx1, sx2,
    BLOCK: tl.constexpr, AMAX_FLOOR: tl.constexpr, INV: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # (matrix, block row)
    bj = tl.program_id(1)  # block column
    m = pid // row_blocks
    bi = pid % row_blocks
    r = bi * BLOCK + tl.arange(0, BLOCK)
    c = bj * BLOCK + tl.arange(0, BLOCK)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    src = x + m.to(tl.int64) * sx0 + r[:, None].to(tl.int64) * sx1 + c[None, :] * sx2
    v = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(v), axis=1), axis=0), AMAX_FLOOR)
    scale = amax * INV
    inv = tl.div_rn(1.0, scale)
    out = (v * inv).to(tl.float8e4nv)
    dst = q + m.to(tl.int64) * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
    tl.store(dst, out, mask=mask)
    n_cols = tl.num_programs(1)
    tl.store(s + pid.to(tl.int64) * n_cols + bj, scale)
