"""The diff of a push against the base the sender keeps, bit for bit, and the base updated.

Each kept tensor is compared with its base as integers of its element size (a bf16
tensor as int16): equal bits are equal values (``-0.0`` and ``0.0`` differ, a NaN equals
itself). A tensor that did not change is left out of the push; one whose sparse form
(:func:`~._record.layout`) takes at most :data:`SPARSE_AT_MOST` of its dense bytes is
sent sparse (its bytes under :func:`~._record.parts_name`); any other is sent dense,
under its own name. The base then holds the pushed version.

On the CPU, with the C extension (``_fastdiff``), runs of tensors are diffed in one
pass over each tensor and its base, on every core without the GIL, into a reused scratch
buffer of at least :data:`SCRATCH_BYTES` (and of each tensor's most sparse bytes): each
block's count, each changed element's value and offset, the base updated in the same
pass; a tensor sent sparse is then copied out of the scratch, its sparse bytes only, into
a second buffer reused push after push (the records are views of it, valid until the next
encode). Without the extension each tensor is done with torch ops (a comparison into a
reused mask, the changed places, the parts), with the same bytes out.

On CUDA there is no host round trip per tensor: a first pass counts the changed elements
of every block of every tensor, one ``.tolist()`` reads the totals of all tensors, and a
second pass writes each sparse tensor's record and its changes into the base. With
Triton each pass is one launch per element size over a table of the tensors
(:func:`encode_by_kernels`, the kernels of ``_diff_kernel``); without it, torch ops a
tensor (the second pass compacts the places with ``nonzero_static``, its size known). A
base kept in host memory is staged on the device in groups of :data:`STAGE_BYTES`, one
read of the totals per group.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..planning._delta_layout import SPARSE_AT_MOST
from ._device_diff import encode_on_device
from ._encoded import Encoded, Entry, choose, sparse
from ._native import THREADS, fastdiff
from ._record import BLOCK, int_view, layout, parts_name

__all__ = [
    "SCRATCH_BYTES", "SPARSE_AT_MOST", "STAGE_BYTES", "Encoded", "encode", "most_sparse",
    "unchanged",
]  # fmt: skip

STAGE_BYTES = 1 << 30  # a host base's tensors staged on the device at once
SCRATCH_BYTES = 64 << 20  # the CPU diff's scratch: the most sparse bytes of a run of tensors
_SCRATCH_ALIGN = 64


def encode(entries: list[Entry], scratch: list[torch.Tensor]) -> Encoded:
    """Encode ``(name, new, base)`` in push order (``base`` None: not kept, sent dense;
    ``new`` of the base's shape and dtype, a strided one compared through a contiguous
    copy) and write the changes into each base. ``scratch``: reused CPU buffers (a list,
    empty at first, grown as needed); the sparse records pushed may be views of them,
    valid until the next call."""
    out = Encoded()
    for group in _groups(entries):
        if group[0][1].device.type == "cuda":
            encode_on_device(group, out)
        elif fastdiff is not None:
            _encode_natively(group, scratch, out)
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


def _encode_on_host(
    name: str, new: torch.Tensor, base: torch.Tensor, scratch: list[torch.Tensor], out: Encoded
) -> None:
    a, b = int_view(new), int_view(base)
    assert a is not None and b is not None
    numel = a.numel()
    if not scratch or scratch[0].numel() < numel or scratch[0].dtype != torch.bool:
        scratch[:] = [torch.empty(numel, dtype=torch.bool)]
    mask = torch.ne(a, b, out=scratch[0][:numel])
    n = int(torch.count_nonzero(mask))  # places are compacted only for a tensor sent sparse
    if choose(name, new, base, n, out):
        idx = mask.nonzero().squeeze(1)
        counts = torch.bincount(idx >> 8, minlength=-(-numel // BLOCK))
        sparse(name, new, a, b, idx, counts, out)


def most_sparse(numel: int, itemsize: int) -> int:
    """The most changed elements a tensor sent sparse carries (0: it never is)."""
    dense = numel * itemsize
    n = max(0, int((SPARSE_AT_MOST * dense - layout(numel, 0, itemsize)[1]) // (itemsize + 1)))
    while layout(numel, n + 1, itemsize)[3] <= SPARSE_AT_MOST * dense:
        n += 1
    while n > 0 and layout(numel, n, itemsize)[3] > SPARSE_AT_MOST * dense:
        n -= 1
    return n


@dataclass
class _Job:
    """A tensor of a native run: ``new`` contiguous, its base, its most sparse changes and
    where its record goes in the scratch."""

    name: str
    given: torch.Tensor  # as the caller gave it (sent dense as it is)
    new: torch.Tensor | None = None  # None: no base, sent dense
    base: torch.Tensor | None = None
    nmax: int = 0
    at: int = 0


class _Records:
    """The sparse records of one encode: views of a buffer kept in ``scratch[1]`` and
    written again by the next encode (its push has sent them by then); one twice the size
    when they outgrow it. A fresh tensor a record costs a page fault a page each push."""

    def __init__(self, scratch: list[torch.Tensor]) -> None:
        self.scratch = scratch
        self.at = 0

    def put(self, data: torch.Tensor) -> torch.Tensor:
        n = data.numel()
        buf = self.scratch[1] if len(self.scratch) > 1 else None
        if buf is None or self.at + n > buf.numel():
            size = max(2 * buf.numel() if buf is not None else 0, n, SCRATCH_BYTES)
            buf = torch.empty(size, dtype=torch.uint8)
            self.scratch[1:] = [buf]
            self.at = 0
        view = buf[self.at : self.at + n]
        # one thread: torch's copy_ waits for every thread of its pool, 9 ms a call when
        # another process holds a core (benchmarks/weights_delta.py --transport shm)
        ctypes.memmove(view.data_ptr(), data.data_ptr(), n)
        self.at += -(-n // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
        return view


def _encode_natively(group: list[Entry], scratch: list[torch.Tensor], out: Encoded) -> None:
    """Encode ``group`` (CPU tensors) with the C extension, in runs whose most sparse
    bytes fit the scratch."""
    if scratch and scratch[0].dtype != torch.uint8:  # the torch diff's mask
        scratch.clear()
    records = _Records(scratch)
    run: list[_Job] = []
    used = 0
    for name, new, base in group:
        if base is None:
            run.append(_Job(name, new))
            continue
        contiguous = new.contiguous()
        numel, itemsize = contiguous.numel(), contiguous.element_size()
        nmax = most_sparse(numel, itemsize)
        need = layout(numel, 0, itemsize)[1] + nmax * (itemsize + 1) if nmax else 0
        need = -(-need // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
        if run and used + need > max(SCRATCH_BYTES, need):
            _diff_run(run, used, scratch, records, out)
            run, used = [], 0
        run.append(_Job(name, new, contiguous, base, nmax, used))
        used += need
    _diff_run(run, used, scratch, records, out)


def _diff_run(
    run: list[_Job], used: int, scratch: list[torch.Tensor], records: _Records, out: Encoded
) -> None:
    if not scratch or scratch[0].numel() < used:
        scratch[:1] = [torch.empty(max(used, SCRATCH_BYTES), dtype=torch.uint8)]
    buf = scratch[0]
    found = fastdiff.diff(
        [
            (j.new.data_ptr(), j.base.data_ptr(), buf.data_ptr() + j.at if j.nmax else 0,
             j.new.numel(), j.new.element_size(), j.nmax, layout(j.new.numel(), 0, 1)[1])
            for j in run
            if j.new is not None and j.base is not None
        ],
        THREADS,
    )  # fmt: skip
    changes = iter(found)
    for j in run:
        if j.new is None:
            out.add(j.name, j.given)
            continue
        n = next(changes)
        numel, itemsize = j.new.numel(), j.new.element_size()
        out.compared += numel
        out.changed += n
        if n == 0:
            continue
        if n > j.nmax:  # the base holds it already
            out.add(j.name, j.given)
            continue
        nbytes = layout(numel, n, itemsize)[3]
        out.pushed.append((parts_name(j.name), records.put(buf[j.at : j.at + nbytes])))
        out.sparse.append((j.name, tuple(j.new.shape), j.new.dtype, n))
        out.sent += nbytes
