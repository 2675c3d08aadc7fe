"""The diff of a push against the base the sender keeps, bit for bit, and the base updated.

Each kept tensor is compared with its base as integers of its element size (a bf16
tensor as int16): equal bits are equal values (``-0.0`` and ``0.0`` differ, a NaN equals
itself). A tensor that did not change is left out of the push; one whose sparse form
(:func:`~._record.layout`) takes at most :data:`SPARSE_AT_MOST` of its dense bytes is
sent sparse (its bytes under :func:`~._record.parts_name`); any other is sent dense,
under its own name. The base then holds the pushed version.

On the CPU each tensor is done in one pass (a comparison into a reused mask, the
changed places, the parts). On CUDA there is no host round trip per tensor: a first
pass counts the changed elements of every block of every tensor, one ``.tolist()``
reads the totals of all tensors, and a second pass writes each sparse tensor's record
and its changes into the base. With Triton each pass is one launch per element size
over a table of the tensors (:func:`encode_by_kernels`, the kernels of
``_diff_kernel``); without it, torch ops a tensor (the second pass compacts the places
with ``nonzero_static``, its size known). A base kept in host memory is staged on the
device in groups of :data:`STAGE_BYTES`, one read of the totals per group.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..planning._delta_layout import SPARSE_AT_MOST
from ._record import BLOCK, int_view, kernels, layout, parts_name

__all__ = ["SPARSE_AT_MOST", "STAGE_BYTES", "Encoded", "encode", "encode_by_kernels", "unchanged"]

STAGE_BYTES = 1 << 30  # a host base's tensors staged on the device at once


@dataclass
class Encoded:
    """A push's encoded tensors: ``pushed`` in push order (the unchanged left out), the
    ``sparse`` entries of the Setup's header (name, shape, dtype, changed elements), the
    elements ``compared`` and how many of them ``changed``, and the bytes ``sent``."""

    pushed: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    sparse: list[tuple[str, tuple[int, ...], torch.dtype, int]] = field(default_factory=list)
    compared: int = 0
    changed: int = 0
    sent: int = 0

    def add(self, name: str, new: torch.Tensor) -> None:
        """``new`` sent dense."""
        self.pushed.append((name, new))
        self.sent += new.numel() * new.element_size()


Entry = tuple[str, torch.Tensor, torch.Tensor | None]


def encode(entries: list[Entry], scratch: list[torch.Tensor]) -> Encoded:
    """Encode ``(name, new, base)`` in push order (``base`` None: not kept, sent dense;
    ``new`` of the base's shape and dtype, a strided one compared through a contiguous
    copy) and write the changes into each base. ``scratch``: a reused CPU mask
    (``[tensor]`` or ``[]``, grown as needed)."""
    out = Encoded()
    for group in _groups(entries):
        if group[0][1].device.type == "cuda":
            _encode_on_device(group, out)
        else:
            for name, new, base in group:
                if base is None:
                    out.add(name, new)
                else:
                    _encode_on_host(name, new, base, scratch, out)
    return out


def unchanged(name: str, new: torch.Tensor, out: Encoded) -> None:
    """Send ``new`` sparse with no change (a push in which nothing changed sends this one)."""
    nbytes = layout(new.numel(), 0, new.element_size())[3]
    data = torch.zeros(nbytes, dtype=torch.uint8, device=new.device)
    out.pushed.append((parts_name(name), data))
    out.sparse.append((name, tuple(new.shape), new.dtype, 0))
    out.sent += nbytes


def _groups(entries: list[Entry]) -> Iterator[list[Entry]]:
    """Runs of ``entries`` done together: on CUDA, up to :data:`STAGE_BYTES` of bases in host
    memory (a device base: every CUDA tensor at once); on the CPU, every tensor."""
    group: list[Entry] = []
    staged = 0
    for e in entries:
        new, base = e[1], e[2]
        host = base is not None and new.device.type == "cuda" and base.device != new.device
        size = base.numel() * base.element_size() if host and base is not None else 0
        if group and (staged + size > STAGE_BYTES or new.device != group[0][1].device):
            yield group
            group, staged = [], 0
        group.append(e)
        staged += size
    if group:
        yield group


def _sparse(
    name: str, new: torch.Tensor, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor,
    counts: torch.Tensor, out: Encoded,
) -> None:  # fmt: skip
    """Send the changes of ``new`` (``a``: its int view) at ``idx`` sparse, and write them
    into the base (``b``: its int view)."""
    n = idx.numel()
    numel, itemsize = a.numel(), a.element_size()
    blocks, values_at, offsets_at, nbytes = layout(numel, n, itemsize)
    data = torch.empty(nbytes, dtype=torch.uint8, device=a.device)
    data[: 2 * blocks].view(torch.int16).copy_(counts)
    data[2 * blocks : values_at].zero_()
    values = data[values_at:offsets_at].view(a.dtype)
    torch.index_select(a, 0, idx, out=values)
    data[offsets_at:].copy_(torch.bitwise_and(idx, BLOCK - 1))
    b.index_copy_(0, idx, values)
    out.pushed.append((parts_name(name), data))
    out.sparse.append((name, tuple(new.shape), new.dtype, n))
    out.sent += nbytes


def _choose(name: str, new: torch.Tensor, base: torch.Tensor, n: int, out: Encoded) -> bool:
    """Account ``n`` changes of ``new``; send it dense (base updated) or leave it out if
    sparse does not pay or nothing changed. True: send it sparse (the caller does)."""
    out.compared += new.numel()
    out.changed += n
    if n == 0:
        return False
    dense = new.numel() * new.element_size()
    if layout(new.numel(), n, new.element_size())[3] <= SPARSE_AT_MOST * dense:
        return True
    base.copy_(new)
    out.add(name, new)
    return False


def _encode_on_host(
    name: str, new: torch.Tensor, base: torch.Tensor, scratch: list[torch.Tensor], out: Encoded
) -> None:
    a, b = int_view(new), int_view(base)
    assert a is not None and b is not None
    numel = a.numel()
    if not scratch or scratch[0].numel() < numel:
        scratch[:] = [torch.empty(numel, dtype=torch.bool)]
    mask = torch.ne(a, b, out=scratch[0][:numel])
    n = int(torch.count_nonzero(mask))  # places are compacted only for a tensor sent sparse
    if _choose(name, new, base, n, out):
        idx = mask.nonzero().squeeze(1)
        counts = torch.bincount(idx >> 8, minlength=-(-numel // BLOCK))
        _sparse(name, new, a, b, idx, counts, out)


def _block_counts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The changed elements of each block (int32), on the device, no sync."""
    numel = a.numel()
    blocks = -(-numel // BLOCK)
    mask = torch.zeros(blocks * BLOCK, dtype=torch.bool, device=a.device)
    torch.ne(a, b, out=mask[:numel])
    return mask.view(blocks, BLOCK).sum(1, dtype=torch.int32)


def _encode_on_device(group: list[Entry], out: Encoded) -> None:
    if kernels(group[0][1].device):
        encode_by_kernels(group, out)
        return
    staged: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # (int views of new, base)
    counts: list[torch.Tensor] = []
    for _, new, base in group:
        if base is None:
            staged.append(None)
            continue
        on = base if base.device == new.device else base.to(new.device, non_blocking=True)
        a, b = int_view(new), int_view(on)
        assert a is not None and b is not None
        staged.append((a, b))
        counts.append(_block_counts(a, b))
    totals = torch.stack([c.sum() for c in counts]).tolist() if counts else []  # the one sync
    it = iter(zip(counts, totals, strict=True))
    for (name, new, base), views in zip(group, staged, strict=True):
        if views is None or base is None:
            out.add(name, new)
            continue
        c, n = next(it)
        a, b = views
        on = b.view(new.dtype).view(new.shape)
        if _choose(name, new, on, int(n), out):
            mask = torch.ne(a, b)
            idx = torch.nonzero_static(mask, size=int(n)).squeeze(1)
            _sparse(name, new, a, b, idx, c, out)
        if base.device != new.device:
            base.copy_(on, non_blocking=True)


def encode_by_kernels(group: list[Entry], out: Encoded) -> None:
    """:func:`encode` of ``group`` (on one device) by the Triton kernels of ``_diff_kernel``:
    one launch a pass and element size, one read of the totals of every tensor."""
    from ._diff_kernel import COUNT, WRITE, count_blocks, write_records

    dev = group[0][1].device
    rows: list[list[int]] = []  # a kept tensor's row of the kernels' table, its element size
    views: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # new's int view, base there
    blocks = 0
    for _, new, base in group:
        if base is None:
            views.append(None)
            continue
        on = base if base.device == dev else base.to(dev, non_blocking=True)
        a, b = int_view(new), int_view(on)
        assert a is not None and b is not None
        views.append((a, on))
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
        a, on = v
        staged = on.view(new.dtype).view(new.shape)
        if _choose(name, new, staged, n, out):
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
