"""Boxes: a region of a tensor as one ``(start, stop)`` per dimension.

What a trainer rank owns of a tensor (an FSDP2 shard: rows ``[a, b)``) and what
an engine rank needs of it (its tensor-parallel slice) are boxes in the full
tensor's coordinates. The intersection of two boxes is a box, so every byte a
receiver needs maps to the one owner that holds it, and a box minus a box is a
few boxes: a set of needed boxes has a disjoint cover that sends each byte once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from rlferry.errors import RequestError

__all__ = [
    "Box",
    "box_str",
    "check_box",
    "chunk_bounds",
    "cover",
    "extents",
    "full_box",
    "intersect",
    "relative",
    "shift",
    "slices",
    "subtract",
    "volume",
]

Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    """The whole tensor of ``shape``."""
    return tuple((0, int(d)) for d in shape)


def extents(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def volume(box: Box) -> int:
    """Elements in ``box`` (0 for an empty one)."""
    return math.prod(max(0, b - a) for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common region of ``a`` and ``b``, or None when they do not overlap."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def subtract(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as disjoint boxes (at most two per dimension)."""
    inter = intersect(a, b)
    if inter is None:
        return [a]
    out: list[Box] = []
    rest = list(a)
    for d, ((lo, hi), (ilo, ihi)) in enumerate(zip(a, inter, strict=True)):
        if lo < ilo:
            out.append((*rest[:d], (lo, ilo), *rest[d + 1 :]))
        if ihi < hi:
            out.append((*rest[:d], (ihi, hi), *rest[d + 1 :]))
        rest[d] = (ilo, ihi)  # later dimensions cut only the part inside b on this one
    return out


def cover(boxes: Iterable[Box]) -> list[Box]:
    """Disjoint boxes whose union is the union of ``boxes``, in first-seen order; a box
    equal to or disjoint from those before it is kept whole."""
    out: list[Box] = []
    for box in dict.fromkeys(boxes):
        parts = [box]
        for have in out:
            if intersect(have, box) is None:
                continue
            parts = [p for q in parts for p in subtract(q, have)]
            if not parts:
                break
        out.extend(parts)
    return out


def relative(box: Box, origin: Box) -> Box:
    """``box`` in the coordinates of a region that starts where ``origin`` does."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))


def shift(box: Box, by: Sequence[int]) -> Box:
    return tuple((a + d, b + d) for (a, b), d in zip(box, by, strict=True))


def slices(box: Box) -> tuple[slice, ...]:
    """Index a tensor with this to get the box's view."""
    return tuple(slice(a, b) for a, b in box)


def box_str(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``n`` that ``torch.chunk(parts)`` gives chunk ``index``
    (``c = ceil(n / parts)`` rows each, the last ones fewer or none), as FSDP2 and
    DTensor's ``Shard`` split a dimension."""
    c = -(-n // parts) if n else 0
    return min(n, index * c), min(n, (index + 1) * c)


def check_box(box: object, shape: Sequence[int], field: str) -> Box:
    """``box`` as a Box inside a tensor of ``shape``, or a ValueError naming ``field``."""
    want = f"one (start, stop) per dimension of shape {list(shape)}"
    try:
        out = tuple((int(a), int(b)) for a, b in box)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise RequestError(
            f"{field}: expected {want}, got {box!r} (give a tuple of (start, stop) pairs)"
        ) from None
    if len(out) != len(shape) or not all(
        0 <= a <= b <= d for (a, b), d in zip(out, shape, strict=False)
    ):
        raise RequestError(
            f"{field}: expected {want} with 0 <= start <= stop <= size, got {box_str(out)} "
            "(a region outside the tensor, or of another rank)"
        )
    return out
