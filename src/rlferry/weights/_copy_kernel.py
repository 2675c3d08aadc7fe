"""The Triton kernel of :class:`GroupedCopy`; imported only when a grouped copy runs on CUDA.

One launch copies every chunk of a table: row ``c`` holds ``(src address,
dst address, 4-byte words)``, every address 16-byte aligned and every length a
multiple of 16 bytes. The grid is ``(chunks, tiles per chunk)``: program
``(c, t)`` copies words ``[t * BLOCK, (t + 1) * BLOCK)`` of chunk ``c`` (masked
at the chunk's end; a program past it returns at once) with 16-byte loads and
stores (the alignment hints make Triton emit ``ld.global.v4.b32``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK_WORDS", "launch"]

BLOCK_WORDS = 4096  # 16 KiB per program: 256 threads, four 16-byte loads each
_WARPS = 8


@triton.jit
def _copy_tiles(table, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    c = tl.program_id(0)
    t = tl.program_id(1)
    row = table + c * 3
    n = tl.multiple_of(tl.load(row + 2), 4)
    start = t * BLOCK
    if start < n:
        src = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int32)), 16)
        dst = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int32)), 16)
        o = start + tl.arange(0, BLOCK)
        m = o < n
        v = tl.load(src + o, mask=m, cache_modifier=".cg")
        tl.store(dst + o, v, mask=m, cache_modifier=".cs")


@triton.jit
def _copy_rows(table, rows, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """A bounded grid: each program copies rows p, p + programs, ... tile by tile (as many
    tiles as the row holds: a short row, a strided view's run, costs one)."""
    for c in range(tl.program_id(0), rows, tl.num_programs(0)):
        row = table + c * 3
        n = tl.multiple_of(tl.load(row + 2), 4)
        src = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int32)), 16)
        dst = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int32)), 16)
        for t in range(0, tl.cdiv(n, BLOCK)):
            o = t * BLOCK + tl.arange(0, BLOCK)
            m = o < n
            v = tl.load(src + o, mask=m, cache_modifier=".cg")
            tl.store(dst + o, v, mask=m, cache_modifier=".cs")


def launch(
    table: torch.Tensor, tiles: int, block: int = BLOCK_WORDS, programs: int | None = None
) -> None:
    """Copy every chunk of ``table`` (int64, shape (chunks, 3), on the device) on the
    current stream; ``tiles``: tiles per chunk (chunk words / ``block``). ``programs``:
    at most that many programs (each looping over chunks), leaving the other SMs free
    (for a collective running beside the copy); None: one program per tile."""
    with torch.cuda.device(table.device):
        if programs is None:
            _copy_tiles[(table.shape[0], tiles)](table, BLOCK=block, num_warps=_WARPS)
        else:
            grid = (min(programs, table.shape[0]),)
            _copy_rows[grid](table, table.shape[0], BLOCK=block, num_warps=_WARPS)
