"""The Triton kernels of the CUDA diff and apply; imported only when they run on CUDA.

A group of tensors of one element size is diffed by two launches over a table. Each
tensor's row of ``tensors`` (int64) holds ``(new address, base address, elements, first
block in the group's counts, record address, values_at, offsets_at)`` (the record's
columns are 0 in the first pass); each row of ``chunks`` (int32) holds ``(tensor, chunk
within it)``. Program ``(c, t)`` takes tile ``t`` of chunk ``c`` (``chunk`` elements a
chunk): :data:`TILE_BLOCKS` blocks of 256 elements, both streams read once with no mask
kept in memory.

- :func:`count_blocks` writes each block's changed elements (int32) into the group's
  counts; a cumsum of them on the device gives every tensor's total and every block's
  first change.
- :func:`write_records` recomputes each block's mask, places each change by an
  exclusive cumsum within the block plus the block's first change, and writes the
  record (:func:`~._record.layout`: counts as int16, the padding zeroed, values, uint8
  offsets) and the changed elements into the base.

:func:`apply` writes a record's values into a tensor by :func:`apply_blocks`, block
by block: each block's first change from a cumsum of the counts, no index tensor built.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._record import BLOCK as BLOCK_ELEMENTS

__all__ = [
    "BLOCK_ELEMENTS", "CHUNK", "COUNT", "TILE_BLOCKS", "WARPS", "WRITE", "apply",
    "apply_blocks", "count_blocks", "write_records",
]  # fmt: skip

CHUNK = 1 << 20  # elements a chunk: a tensor's chunks balance the grid
# (blocks a program, warps) of each pass, the fastest measured over Qwen3-8B's 399 bf16
# tensors at 1% changed on an H200 (`python benchmarks/_diff_tune.py`): the count streams
# wide tiles (11.5 ms for 16.4 GB, a copy takes 8.8); the write, whose cumsum within a
# block and scattered stores want a warp a block, 21 ms at one block a program against
# 80 at 16 blocks and 8 warps.
COUNT = (16, 8)
WRITE = (1, 1)
TILE_BLOCKS, WARPS = 16, 8  # the apply's
COLS: tl.constexpr = tl.constexpr(7)  # a tensor's row


@triton.jit
def _as_ints(addr, ITEMSIZE: tl.constexpr):  # type: ignore[no-untyped-def]
    """``addr`` (int64) as a pointer to integers of ``ITEMSIZE`` bytes."""
    if ITEMSIZE == 1:
        p = addr.to(tl.pointer_type(tl.uint8))
    elif ITEMSIZE == 2:
        p = addr.to(tl.pointer_type(tl.int16))
    elif ITEMSIZE == 4:
        p = addr.to(tl.pointer_type(tl.int32))
    else:
        p = addr.to(tl.pointer_type(tl.int64))
    return p


@triton.jit
def _tile(tensors, chunks, chunk, TILE: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """This program's tensor row, its first element, and its tile's element places
    ``(TILE, BLOCK)`` within the tensor."""
    c = tl.program_id(0)
    i = tl.load(chunks + 2 * c)
    k = tl.load(chunks + 2 * c + 1)
    row = tensors + i.to(tl.int64) * COLS
    first = k.to(tl.int64) * chunk + tl.program_id(1) * (TILE * BLOCK)
    blocks = first // BLOCK + tl.arange(0, TILE)
    places = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return row, first, blocks, places


@triton.jit
def count_blocks(  # type: ignore[no-untyped-def]
    tensors, chunks, counts, chunk,
    ITEMSIZE: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row, first, blocks, places = _tile(tensors, chunks, chunk, TILE, BLOCK)
    numel = tl.load(row + 2)
    if first < numel:
        a = _as_ints(tl.load(row), ITEMSIZE)
        b = _as_ints(tl.load(row + 1), ITEMSIZE)
        inside = places < numel
        x = tl.load(a + places, mask=inside, other=0, cache_modifier=".cg")
        y = tl.load(b + places, mask=inside, other=0, cache_modifier=".cg")
        n = tl.sum((x != y).to(tl.int32), axis=1)
        tl.store(counts + tl.load(row + 3) + blocks, n, mask=blocks * BLOCK < numel)


@triton.jit
def write_records(  # type: ignore[no-untyped-def]
    tensors, chunks, starts, chunk,
    ITEMSIZE: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``starts``: the group's exclusive cumsum of counts (int64, one more than blocks)."""
    row, first, blocks, places = _tile(tensors, chunks, chunk, TILE, BLOCK)
    numel = tl.load(row + 2)
    if first < numel:
        a = _as_ints(tl.load(row), ITEMSIZE)
        b = _as_ints(tl.load(row + 1), ITEMSIZE)
        at0 = tl.load(row + 4)
        record = at0.to(tl.pointer_type(tl.uint8))
        values_at = tl.load(row + 5)
        offsets_at = tl.load(row + 6)
        g0 = tl.load(row + 3)
        if first == 0:  # the padding between the counts and the values
            pad = 2 * ((numel + BLOCK - 1) // BLOCK) + tl.arange(0, 16)
            tl.store(record + pad, tl.zeros((16,), dtype=tl.uint8), mask=pad < values_at)
        inside = places < numel
        x = tl.load(a + places, mask=inside, other=0, cache_modifier=".cg")
        y = tl.load(b + places, mask=inside, other=0, cache_modifier=".cg")
        changed = x != y
        m = changed.to(tl.int32)
        live = blocks * BLOCK < numel
        n = tl.sum(m, axis=1)
        tl.store(at0.to(tl.pointer_type(tl.int16)) + blocks, n.to(tl.int16), mask=live)
        start = tl.load(starts + g0 + blocks, mask=live, other=0) - tl.load(starts + g0)
        at = start[:, None] + (tl.cumsum(m, axis=1) - m)
        values = _as_ints(at0 + values_at, ITEMSIZE)
        tl.store(values + at, x, mask=changed)
        offsets = (places % BLOCK).to(tl.uint8)
        tl.store(record + offsets_at + at, offsets, mask=changed)
        tl.store(b + places, x, mask=changed)


@triton.jit
def apply_blocks(  # type: ignore[no-untyped-def]
    flat, counts, starts, offsets, values, blocks,
    TILE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Write the changes of blocks ``[pid * TILE, (pid + 1) * TILE)`` into ``flat``;
    ``starts``: each block's first change (int64)."""
    bl = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    live = bl < blocks
    n = tl.load(counts + bl, mask=live, other=0).to(tl.int32)
    s = tl.load(starts + bl, mask=live, other=0)
    j = tl.arange(0, BLOCK)
    take = j[None, :] < n[:, None]
    at = s[:, None] + j[None, :]
    off = tl.load(offsets + at, mask=take, other=0).to(tl.int64)
    v = tl.load(values + at, mask=take)
    tl.store(flat + bl[:, None] * BLOCK + off, v, mask=take)


def apply(
    flat: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor
) -> None:
    """Write a record's ``values`` (of ``flat``'s integer dtype) at its ``counts`` and
    ``offsets`` into ``flat`` (all on one device), on the current stream: a cumsum and one
    launch."""
    blocks = counts.numel()
    starts = torch.cumsum(counts, 0, dtype=torch.int64).sub_(counts)
    grid = (triton.cdiv(blocks, TILE_BLOCKS),)
    with torch.cuda.device(flat.device) if flat.is_cuda else torch.device(flat.device):
        apply_blocks[grid](
            flat, counts, starts, offsets, values, blocks, TILE=TILE_BLOCKS,
            BLOCK=BLOCK_ELEMENTS, num_warps=WARPS,
        )  # fmt: skip
