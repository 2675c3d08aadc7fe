"""Long lists of strings or bytes travel packed: one data frame and one offsets frame.

Packed, a column of 1024 prompts crosses the wire like a tensor: out of band,
through shared memory over ipc://, never through the msgpack header. A service
that only stores and forwards such columns (a storage unit) decodes them as
:class:`PackedStrings` and sends slices of them on without ever building
Python strings; everyone else gets the list back.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import WireError
from ..memory._copies import THREADS, copy_many, fastcopy, side_by_side
from ..memory._segments import BULK_MIN, shared_empty

__all__ = ["PackedStrings", "pack_strings"]

KINDS = {"s": str, "b": bytes}


class PackedStrings:
    """A list of str (``kind="s"``) or bytes (``kind="b"``) as UTF-8 data plus offsets.

    ``offsets`` (int64, one more than there are items) index into ``data``
    (uint8); slicing rows gives a view, no copy.
    """

    __slots__ = ("data", "kind", "offsets")

    def __init__(self, kind: str, offsets: torch.Tensor, data: torch.Tensor) -> None:
        self.kind = kind
        self.offsets = offsets
        self.data = data

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, rows: slice) -> PackedStrings:
        start, stop, step = rows.indices(len(self))
        if step != 1:
            raise IndexError("PackedStrings supports contiguous row slices only")
        return PackedStrings(self.kind, self.offsets[start : max(start, stop) + 1], self.data)

    @property
    def nbytes(self) -> int:
        return int(self.offsets[-1] - self.offsets[0]) if len(self) else 0

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets from 0, the data they index): what travels."""
        first = int(self.offsets[0])
        return self.offsets - first, self.data[first : int(self.offsets[-1])]

    def tolist(self) -> list[Any]:
        offsets, data = self.parts()
        bounds = offsets.tolist()
        if fastcopy is not None and data.numel() >= _FILL_IN_PARALLEL and len(bounds) > 2:
            items = _filled(self.kind == "s", data, bounds)
            if items is not None:
                return items
        raw = _view(data)
        if self.kind == "s":
            return [str(raw[a:b], "utf-8") for a, b in itertools.pairwise(bounds)]
        return [bytes(raw[a:b]) for a, b in itertools.pairwise(bounds)]

    @staticmethod
    def concat(parts: Sequence[PackedStrings]) -> PackedStrings:
        """One packed column of several (one copy of the data)."""
        pieces = [p.parts() for p in parts]
        data = shared_empty([sum(d.numel() for _, d in pieces)], torch.uint8)
        offsets, jobs, at = [torch.zeros(1, dtype=torch.int64)], [], 0
        for o, d in pieces:
            jobs.append((data.data_ptr() + at, d.data_ptr(), d.numel()))
            offsets.append(o[1:] + at)
            at += d.numel()
        copy_many(jobs)  # `pieces` keeps the sources alive
        return PackedStrings(parts[0].kind, torch.cat(offsets), data)


# A large column comes back as items made empty under the GIL and filled without it, by
# this thread and the copy helpers side by side: filling faults in the items' fresh heap
# pages, which costs more than the copy (TransferQueue's complex case: 3 columns of
# 1024 x 32 KiB strings, 30 -> 12 ms on the 2-core VM).
_FILL_IN_PARALLEL = 1 << 20


def _filled(is_str: bool, data: torch.Tensor, bounds: list[int]) -> list[Any] | None:
    """The items, or None when a str column holds non-ASCII text (decoded as UTF-8 then)."""
    assert fastcopy is not None
    items = fastcopy.empty_strings(bounds, is_str)
    parts = THREADS
    cuts = [bisect.bisect_left(bounds, bounds[-1] * k // parts) for k in range(parts)]
    cuts = sorted({min(c, len(items)) for c in cuts} | {len(items)})
    base = data.data_ptr()
    calls = [
        functools.partial(fastcopy.fill_strings, items, a, b, base, bounds)
        for a, b in itertools.pairwise(cuts)
    ]
    return items if all(side_by_side(calls)) else None


def _view(t: torch.Tensor) -> memoryview:
    n = t.numel()
    if n == 0:
        return memoryview(b"")
    holder = (ctypes.c_char * n).from_address(t.data_ptr())
    holder._rlferry_owner = t  # type: ignore[attr-defined]
    return memoryview(holder).cast("B")


def _address_of(b: bytes) -> int:
    """Where a bytes object keeps its data (c_char_p points into it, no copy)."""
    return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value or 0


_as_utf8 = ctypes.pythonapi.PyUnicode_AsUTF8AndSize
_as_utf8.restype = ctypes.c_void_p
_as_utf8.argtypes = [ctypes.py_object, ctypes.POINTER(ctypes.c_ssize_t)]


def pack_strings(items: list[Any]) -> PackedStrings | None:
    """Pack a list whose items are all str or all bytes, when it is worth it (>= 64 KiB)."""
    if len(items) < 2:
        return None
    kind_type = type(items[0])
    if kind_type not in (str, bytes) or not all(type(v) is kind_type for v in items):
        return None
    # Item by item, straight into shared memory: one joined temporary would be tens of MB
    # of fresh pages, which cost more to fault in than the copy itself.
    if sum(map(len, items)) * (1 if kind_type is bytes else 4) < BULK_MIN:
        return None  # too short even at 4 bytes a character (field names, short lists)
    sources: list[Any]
    if kind_type is bytes:
        sources, lengths = items, list(map(len, items))
    elif all(map(str.isascii, items)):  # CPython keeps ASCII text as UTF-8 already
        sources = [_as_utf8(v, None) for v in items]  # pointers into the strs, alive in items
        lengths = list(map(len, items))
    else:
        sources = [v.encode() for v in items]
        lengths = list(map(len, sources))
    total = sum(lengths)
    if total < BULK_MIN:
        return None
    data = shared_empty([total], torch.uint8)
    jobs, at, base = [], 0, data.data_ptr()
    for src, n in zip(sources, lengths, strict=True):
        jobs.append((base + at, src if isinstance(src, int) else _address_of(src), n))
        at += n
    copy_many(jobs)  # sources stay alive: `items` (and `sources`) hold them
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
    return PackedStrings("s" if kind_type is str else "b", offsets, data)


def check_offsets(offsets: torch.Tensor, size: int, what: str = "string") -> None:
    """Offsets must start at 0, end at ``size`` and never decrease (checked before use)."""
    if (
        offsets.dim() != 1
        or offsets.dtype != torch.int64
        or offsets.numel() < 1
        or int(offsets[0]) != 0
        or int(offsets[-1]) != size
        or bool((offsets[1:] < offsets[:-1]).any())
    ):
        raise WireError(f"malformed message: {what} offsets do not describe the data")
