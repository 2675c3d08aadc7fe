"""A receiver's side of delta pushes: what its ``load`` gets, in each mode.

``in_place``: each sparse tensor as ``(name, Delta)`` (the load applies it to the
engine's own tensor, :class:`~rlferry.weights.ParamLoader` does), each dense one as
usual. ``base``: the receiver keeps a copy of its last committed version (a
:class:`Kept`), applies each delta to it and hands the load the whole tensor rebuilt, for
the tensors the push carries only (an engine whose loader takes checkpoint tensors).
``whole``: as ``base``, but a delta push hands the load every tensor of the version once
its last bucket came (from the copy, in push order): for a loader that must see every
tensor of a layer to reload it (vLLM's layerwise reload materializes a layer anew from
the tensors loaded into it, and one loaded in part would hold garbage where none came).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._errors import WeightSyncError
from ..planning._buckets import Plan
from ..planning._specs import TensorSpec
from ._header import DeltaHeader
from ._record import SUFFIX, Delta

__all__ = ["MODES", "Kept", "Receiving", "decode"]

MODES = ("in_place", "base", "whole")


class Kept:
    """A receiver's copy of its last version, tensor by tensor: in host memory (pinned
    when the pushed tensors are on CUDA) or, ``where="device"``, on their device."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.tensors: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def retain(self, names: set[str]) -> None:
        """Keep only the tensors of ``names``."""
        self.tensors = {n: t for n, t in self.tensors.items() if n in names}

    def put(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Keep ``t`` (a copy) as ``name``; the copy."""
        kept = self.tensors.get(name)
        if kept is None or kept.shape != t.shape or kept.dtype != t.dtype:
            if self.where == "device" or t.device.type != "cuda":
                kept = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            else:
                kept = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.tensors[name] = kept
        return kept.copy_(t)

    def apply(self, name: str, delta: Delta) -> torch.Tensor:
        """``delta`` applied to the kept ``name``; the whole tensor."""
        kept = self.tensors.get(name)
        if kept is None:
            raise WeightSyncError(
                f"a delta of `{name}` came, and this receiver keeps no base of it (a bug: "
                "the sender checks that the receiver holds the base version)"
            )
        return delta.apply_(kept)


def decode(
    items: list[tuple[str, Any]], header: DeltaHeader | None, kept: Kept | None,
    whole: bool = False,
) -> Any:  # fmt: skip
    """The items a receiver's ``load`` gets for ``items`` of a push (``header``: its delta
    header, None for a full push; ``kept``: the copy a ``base`` or ``whole`` receiver
    keeps, else None; ``whole``: a delta push loads nothing until its last bucket). A
    full push to an ``in_place`` receiver: ``items`` as they are."""
    if header is None:
        if kept is not None:
            for name, t in items:
                kept.put(name, t)
        return items
    sparse: Mapping[str, tuple[str, tuple[int, ...], torch.dtype, int]] = {
        n + SUFFIX: (n, s, dt, c) for n, s, dt, c in header.sparse
    }
    out: list[tuple[str, Any]] = []
    for name, t in items:
        entry = sparse.get(name)
        if entry is None:
            if kept is not None:
                kept.put(name, t)
            out.append((name, t))
            continue
        real, shape, dtype, changed = entry
        delta = Delta.from_bytes(t, shape, dtype, changed)
        out.append((real, kept.apply(real, delta) if kept is not None else delta))
    return [] if whole else out


class Receiving:
    """A receiver's side of delta pushes (``mode``: None, ``"in_place"`` or ``"base"``):
    the version it holds whole (``holds``: None until its first commit, and from the
    first load of a push until that push commits), the header of the push in progress,
    and, in ``base`` mode, the copy it keeps (in host memory, or ``where="device"``)."""

    def __init__(self, mode: str | None, where: str) -> None:
        self.mode = mode
        self.holds: int | None = None
        self.kept = Kept(where) if mode in ("base", "whole") else None
        self._seq = 0  # the push in progress
        self._header: DeltaHeader | None = None  # its header (None: a full push)

    def message(self, seq: int) -> None:
        """A message of push ``seq`` came: a push that sent no Setup here is a full one."""
        if seq != self._seq:
            self._seq, self._header = seq, None

    def setup(self, wire: dict[str, Any] | None, plan: Plan) -> list[TensorSpec] | None:
        """The Setup of the push in progress carried ``wire`` (its delta header, or None):
        the tensors it updates, to check against the receiver's parameters (None: the
        plan's). Raises ``WeightSyncError`` with the reason it refuses the push."""
        self._header = None
        if wire is None:
            if self.kept is not None:  # a full push's layout: what it lacks is kept no more
                self.kept.retain({spec.name for spec in plan.specs})
            return None
        if self.mode is None:
            raise WeightSyncError(
                "this receiver was made without deltas= (a sender of another rlferry "
                "version, or a bug: please report it)"
            )
        header = DeltaHeader.from_wire(wire)
        if header.base != self.holds:
            held = "no whole version" if self.holds is None else f"version {self.holds}"
            raise WeightSyncError(
                f"it is made against version {header.base}, this receiver holds {held} (its "
                "version changed since it last told the sender, or it loaded part of a push "
                "since); it keeps serving its version, and its next push is full"
            )
        specs = header.specs(plan)
        self._header = header
        return specs

    def items(self, items: list[tuple[str, Any]]) -> Any:
        """What ``load`` gets for ``items`` of the push in progress (see :func:`decode`);
        the receiver holds no whole version until the push commits."""
        self.holds = None
        if self.mode is None:
            return items
        return decode(items, self._header, self.kept, self.mode == "whole")

    def last(self) -> list[tuple[str, torch.Tensor]]:
        """What ``load`` gets once the last bucket of the push in progress was loaded: every
        kept tensor after a delta push to a ``whole`` receiver, else nothing."""
        if self.mode != "whole" or self._header is None or self.kept is None:
            return []
        return list(self.kept.tensors.items())

    def written(self) -> None:
        """The sender wrote into the receiver's tensors (or offered to): no whole version."""
        self.holds = None

    def committed(self, version: int) -> None:
        self.holds = version
