"""A push's buckets copied aside while a step is in flight, loaded before the next one.

A push that comes while the engine steps would wait for that step (a decode step of 512
rows beside a trainer on the same GPU: 8-16 ms) before its first bucket loads, and its
sender with it. Staged, a bucket is copied into tensors of the engine's own (one device
copy; the sender's memory is free once it ends), the push commits, and the engine loads
the copies into the model at the step's end, before its next step: every step still
reads one version. The copies are kept for the next push (the staged tensors' bytes
again, on the engine's device)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from rlferry.weights import ParamLoader

__all__ = ["Staging"]

Loader = Callable[[list[tuple[str, Any]]], Any]


class _Copies(list[tuple[str, torch.Tensor]]):
    """A bucket's copies, as ``(name, tensor)``: a list a ``ParamLoader`` keeps its grouped
    copy of (one it can watch)."""


class Staging:
    """The copies and the loads they wait for. ``stage`` runs on a receiver's thread
    without the engine's lock; the rest under it. A bucket's copies and the grouped copy
    into them are made once per list of its views the receiver hands (the same list push
    after push while the plan holds), so a staged push costs two grouped copies."""

    def __init__(self) -> None:
        self._buckets: dict[int, tuple[ParamLoader, _Copies]] = {}  # by id of the views' list
        self._pending: list[tuple[Loader, _Copies]] = []
        self.committed = False  # the pending loads' push committed: load them at the boundary

    @staticmethod
    def can_stage(items: list[tuple[str, Any]]) -> bool:
        """Whether ``items`` are tensors to copy (a delta push's sparse items are applied to
        the model's tensors by the load itself: they wait for the step instead)."""
        return all(isinstance(t, torch.Tensor) for _, t in items)

    def stage(self, loader: Loader, items: list[tuple[str, torch.Tensor]]) -> None:
        """Copy ``items`` aside (on the calling thread's stream, waited for: the sender may
        reuse its memory once this returns) and remember ``loader``'s load of the copies."""
        entry = self._buckets.get(id(items))
        if entry is None:
            copies = _Copies(
                (n, torch.empty_like(t, memory_format=torch.contiguous_format)) for n, t in items
            )
            entry = (ParamLoader(dict(copies)), copies)
            if type(items).__weakrefoffset__:  # the receiver's list: kept while it lives
                weakref.finalize(items, self._buckets.pop, id(items), None)
                self._buckets[id(items)] = entry  # (a plain list's copies serve once)
        into, copies = entry
        into(items)
        if copies and copies[0][1].is_cuda:
            torch.cuda.current_stream(copies[0][1].device).synchronize()
        self._pending.append((loader, copies))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def load(self) -> None:
        """Load every pending copy into the model (on the calling thread's stream, waited
        for: the next push may write the copies again)."""
        pending, self._pending, self.committed = self._pending, [], False
        for loader, copies in pending:
            loader(copies)
        devices = {t.device for _, copies in pending for _, t in copies if t.is_cuda}
        for d in devices:
            torch.cuda.current_stream(d).synchronize()

    def drop(self) -> None:
        """Forget the pending loads (their push failed: the model keeps what it holds)."""
        self._pending, self.committed = [], False
