"""The base a sender keeps: the bytes of the version it pushed last, tensor by tensor.

The first tensors of the push (in push order) that fit the budget are kept, each whole;
a tensor that does not fit is skipped and later ones may still fit; the tensors not
kept are always sent dense. ``device``: beside the pushed tensors (the trainer's GPU, or
ordinary memory for CPU tensors); ``host``: in host memory (pinned for CUDA tensors).
"""

from __future__ import annotations

import torch

from ._encoding import Encoded, encode
from ._record import comparable

__all__ = ["WHERE", "KeptBase"]

WHERE = ("device", "host")
Pairs = list[tuple[str, torch.Tensor]]


class KeptBase:
    """The kept tensors of the last version pushed (``version``; None: none kept, or not
    kept up since), within ``budget`` bytes."""

    def __init__(self, budget: int, where: str) -> None:
        self.budget = budget
        self.where = where
        self.version: int | None = None
        self.nbytes = 0  # kept now
        self._layout: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self.kept: list[torch.Tensor | None] = []
        self._scratch: list[torch.Tensor] = []  # a CPU mask, reused

    def matches(self, pairs: Pairs) -> bool:
        """Whether ``pairs`` can be diffed against the base: it holds a version of their
        names, shapes and dtypes, in order."""
        return self.version is not None and self._same_layout(pairs)

    def drop(self) -> None:
        """The base is not kept up with this push (its memory stays for the next)."""
        self.version = None

    def refresh(self, pairs: Pairs, version: int) -> None:
        """Keep ``pairs`` (a full push of ``version``): a copy of each kept tensor."""
        if not self._same_layout(pairs):
            self._allocate(pairs)
        for (_, t), kept in zip(pairs, self.kept, strict=True):
            if kept is not None:
                kept.copy_(t, non_blocking=kept.device.type == "cuda")
        self.version = version

    def encode(self, pairs: Pairs, version: int) -> Encoded:
        """The delta of ``pairs`` from the base (see ``_encoding``); the base then holds
        ``version``. Call it only when :meth:`matches`."""
        entries = [(n, t, k) for (n, t), k in zip(pairs, self.kept, strict=True)]
        out = encode(entries, self._scratch)
        self.version = version
        return out

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() for t in self._scratch)

    def _same_layout(self, pairs: Pairs) -> bool:
        return len(pairs) == len(self._layout) and all(
            n == k[0] and t.dtype == k[2] and tuple(t.shape) == k[1]
            for (n, t), k in zip(pairs, self._layout, strict=True)
        )

    def _allocate(self, pairs: Pairs) -> None:
        self.kept, self._layout, self.nbytes = [], [], 0
        self._scratch.clear()
        for n, t in pairs:
            self._layout.append((n, tuple(t.shape), t.dtype))
            size = t.numel() * t.element_size()
            fits = size > 0 and self.nbytes + size <= self.budget and comparable(t.dtype)
            self.kept.append(self._alloc(t) if fits else None)
            self.nbytes += size if fits else 0

    def _alloc(self, t: torch.Tensor) -> torch.Tensor:
        if self.where == "host" and t.device.type == "cuda":
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
