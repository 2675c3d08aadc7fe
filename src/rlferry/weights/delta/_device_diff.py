"""The diff on CUDA: no host round trip per tensor (see :mod:`._encoding`): Triton kernels
over a table of the tensors (:func:`encode_by_kernels`) where Triton is, torch ops a tensor
where it is not."""

from __future__ import annotations

from typing import Any

import torch

from ._encoded import Encoded, Entry, choose, sparse
from ._record import BLOCK, int_view, kernels, layout, parts_name

__all__ = ["encode_by_kernels", "encode_on_device"]


def block_counts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The changed elements of each block (int32), on the device, no sync."""
    numel = a.numel()
    blocks = -(-numel // BLOCK)
    mask = torch.zeros(blocks * BLOCK, dtype=torch.bool, device=a.device)
    torch.ne(a, b, out=mask[:numel])
    return mask.view(blocks, BLOCK).sum(1, dtype=torch.int32)


def _staged(
    group: list[Entry], dev: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per entry: the integer views of its new tensor and of its base on ``dev`` (a base
    elsewhere copied there, without a sync), or None without a base."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for _, new, base in group:
        if base is None:
            out.append(None)
            continue
        on = base if base.device == dev else base.to(dev, non_blocking=True)
        a, b = int_view(new), int_view(on)
        assert a is not None and b is not None
        out.append((a, b))
    return out


def encode_on_device(group: list[Entry], out: Encoded) -> None:
    if kernels(group[0][1].device):
        encode_by_kernels(group, out)
        return
    staged = _staged(group, group[0][1].device)  # (int views of new, base) each
    counts = [block_counts(*v) for v in staged if v is not None]
    totals = torch.stack([c.sum() for c in counts]).tolist() if counts else []  # the one sync
    it = iter(zip(counts, totals, strict=True))
    for (name, new, base), views in zip(group, staged, strict=True):
        if views is None or base is None:
            out.add(name, new)
            continue
        c, n = next(it)
        a, b = views
        on = b.view(new.dtype).view(new.shape)
        if choose(name, new, on, int(n), out):
            mask = torch.ne(a, b)
            idx = torch.nonzero_static(mask, size=int(n)).squeeze(1)
            sparse(name, new, a, b, idx, c, out)
        if base.device != new.device:
            base.copy_(on, non_blocking=True)


def encode_by_kernels(group: list[Entry], out: Encoded) -> None:
    """:func:`encode` of ``group`` (on one device) by the Triton kernels of ``_diff_kernel``:
    one launch a pass and element size, one read of the totals of every tensor."""
    from ._diff_kernel import COUNT, WRITE, count_blocks, write_records

    dev = group[0][1].device
    rows: list[list[int]] = []  # a kept tensor's row of the kernels' table, its element size
    views = _staged(group, dev)  # (int views of new, base there) each
    blocks = 0
    for a, b in (v for v in views if v is not None):
        rows.append([a.data_ptr(), b.data_ptr(), a.numel(), blocks, 0, 0, 0, a.element_size()])
        blocks += -(-a.numel() // BLOCK)
    totals: list[int] = []
    if rows:
        counts = torch.empty(blocks, dtype=torch.int32, device=dev)
        _launch(count_blocks, rows, counts, dev, COUNT)
        starts = torch.zeros(blocks + 1, dtype=torch.int64, device=dev)
        torch.cumsum(counts, 0, out=starts[1:])
        ends = torch.tensor([[r[3], r[3] + -(-r[2] // BLOCK)] for r in rows], device=dev)
        totals = (starts[ends[:, 1]] - starts[ends[:, 0]]).tolist()  # the one sync
    sparse: list[list[int]] = []
    back: list[tuple[torch.Tensor, torch.Tensor]] = []  # host bases, their staged copies
    it = iter(zip(rows, totals, strict=True))
    for (name, new, base), v in zip(group, views, strict=True):
        if v is None or base is None:
            out.add(name, new)
            continue
        row, n = next(it)
        a, b = v
        staged = b.view(new.dtype).view(new.shape)
        if choose(name, new, staged, n, out):
            _, values_at, offsets_at, nbytes = layout(a.numel(), n, a.element_size())
            data = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            sparse.append([*row[:4], data.data_ptr(), values_at, offsets_at, row[7]])
            out.pushed.append((parts_name(name), data))
            out.sparse.append((name, tuple(new.shape), new.dtype, n))
            out.sent += nbytes
        if base.device != dev:
            back.append((base, staged))
    if sparse:
        _launch(write_records, sparse, starts, dev, WRITE)
    for base, staged in back:
        base.copy_(staged, non_blocking=True)


def _launch(
    kernel: Any, rows: list[list[int]], arg: torch.Tensor, dev: torch.device,
    shape: tuple[int, int],
) -> None:  # fmt: skip
    """``kernel`` over the tensors of ``rows`` (the last column: their element size), one
    launch an element size: a table of their rows and one of their chunks (see
    ``_diff_kernel``)."""
    from ._diff_kernel import BLOCK_ELEMENTS, CHUNK

    tile_blocks, warps = shape  # blocks a program, warps
    tile = tile_blocks * BLOCK_ELEMENTS
    for size in sorted({r[-1] for r in rows}):
        mine = [r[:-1] for r in rows if r[-1] == size]
        table = torch.tensor(mine, dtype=torch.int64)
        tiles = -(-table[:, 2] // tile)  # each tensor's
        per_chunk = min(CHUNK // tile, int(tiles.max()))
        chunks = -(-tiles // per_chunk)
        which = torch.repeat_interleave(torch.arange(len(mine)), chunks)
        within = torch.arange(which.numel()) - torch.repeat_interleave(
            chunks.cumsum(0) - chunks, chunks
        )
        pairs = torch.stack([which, within], 1).to(torch.int32)
        grid = (pairs.shape[0], per_chunk)
        with torch.device(dev) if dev.type != "cuda" else torch.cuda.device(dev):
            kernel[grid](
                table.to(dev), pairs.to(dev), arg, per_chunk * tile, ITEMSIZE=size,
                TILE=tile_blocks, BLOCK=BLOCK_ELEMENTS, num_warps=warps,
            )  # fmt: skip
