"""A push's encoded tensors (:class:`Encoded`) and the choice each changed tensor gets:
sent sparse (its record, :func:`sparse`), dense, or left out (:func:`choose`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..planning._delta_layout import SPARSE_AT_MOST
from ._record import BLOCK, layout, parts_name

__all__ = ["Encoded", "Entry", "choose", "sparse"]


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


def sparse(
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


def choose(name: str, new: torch.Tensor, base: torch.Tensor, n: int, out: Encoded) -> bool:
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
