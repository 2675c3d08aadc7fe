"""The samples a ``BatchMeta`` names, one entry each, held as arrays.

Global indexes are one int64 array, the partition one string while every sample shares it
(else one string per sample), and the per-sample dicts
(``custom`` meta, the storage backend's meta) exist only once someone reads or sets them: a
batch of 100k samples is a handful of Python objects, not 100k.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Samples", "one_or_each", "writable"]

Dicts = list[dict[str, Any]]


def writable(value: Any) -> Any:
    """``value``, or a copy of it if it is a read-only array (as arrays deserialized
    zero-copy are, by Ray for one)."""
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        return value.copy()  # arrays deserialized zero-copy are read-only
    return value


def one_or_each(pids: list[str]) -> str | list[str]:
    """A batch's partition ids as held: the one id all samples share, or the list."""
    return pids[0] if pids and pids.count(pids[0]) == len(pids) else pids


class Samples:
    """Global indexes, partition and the optional per-sample dicts."""

    __slots__ = ("backend", "custom", "indexes", "partition")

    def __init__(
        self,
        indexes: np.ndarray,
        partition: str | list[str],
        custom: Dicts | None = None,
        backend: Dicts | None = None,
    ) -> None:
        self.indexes = indexes
        self.partition = partition
        self.custom = custom
        self.backend = backend

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, s) for s in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for slot, value in zip(self.__slots__, state, strict=True):
            setattr(self, slot, writable(value))

    def __len__(self) -> int:
        return len(self.indexes)

    def partition_ids(self) -> list[str]:
        if isinstance(self.partition, str):
            return [self.partition] * len(self.indexes)
        return list(self.partition)

    def locate(self, i: int) -> tuple[int, str]:
        """The global index and the partition of the sample at position ``i``."""
        pid = self.partition if isinstance(self.partition, str) else self.partition[i]
        return int(self.indexes[i]), pid

    def custom_list(self) -> Dicts:
        """The per-sample custom meta, made (empty dicts) on first use."""
        if self.custom is None:
            self.custom = [{} for _ in range(len(self.indexes))]
        return self.custom

    def backend_list(self) -> Dicts:
        """The per-sample backend meta, made (empty dicts) on first use."""
        if self.backend is None:
            self.backend = [{} for _ in range(len(self.indexes))]
        return self.backend

    def take(self, rows: np.ndarray) -> Samples:
        """The samples at positions ``rows`` (already checked), their dicts copied."""
        pids = self.partition
        if not isinstance(pids, str):
            pids = [pids[i] for i in rows]
        out = Samples(self.indexes[rows], pids)
        if self.custom is not None:
            out.custom = [copy.deepcopy(self.custom[i]) for i in rows.tolist()]
        if self.backend is not None:
            out.backend = [copy.deepcopy(self.backend[i]) for i in rows.tolist()]
        return out

    def with_fields(self, wanted: set[str]) -> Samples:
        """A copy whose backend meta keeps only the ``wanted`` fields (and private keys)."""
        pids = self.partition if isinstance(self.partition, str) else list(self.partition)
        out = Samples(self.indexes.copy(), pids)
        if self.custom is not None:
            out.custom = copy.deepcopy(self.custom)
        if self.backend is not None:
            out.backend = [
                {f: v for f, v in m.items() if f.startswith("_") or f in wanted}
                for m in self.backend
            ]
        return out

    def reorder(self, rows: np.ndarray) -> None:
        """Put the samples in the order ``rows`` (a permutation, already checked), in place."""
        self.indexes = self.indexes[rows]
        if not isinstance(self.partition, str):
            self.partition = [self.partition[i] for i in rows]
        order = rows.tolist()
        if self.custom is not None:
            self.custom = [self.custom[i] for i in order]
        if self.backend is not None:
            self.backend = [self.backend[i] for i in order]

    def update_dicts(self, other: Samples) -> None:
        """Merge ``other``'s per-sample dicts into these (the same samples), ``other`` winning."""
        if other.custom is not None:
            for mine, theirs in zip(self.custom_list(), other.custom, strict=True):
                mine.update(copy.deepcopy(theirs))
        if other.backend is not None:
            for mine, theirs in zip(self.backend_list(), other.backend, strict=True):
                mine.update(copy.deepcopy(theirs))

    @staticmethod
    def concat(parts: Sequence[Samples]) -> Samples:
        """The samples of ``parts`` in order (at least one part)."""
        first = parts[0].partition
        pids: str | list[str]
        if all(isinstance(p.partition, str) and p.partition == first for p in parts):
            pids = first
        else:
            pids = [pid for p in parts for pid in p.partition_ids()]
        out = Samples(np.concatenate([p.indexes for p in parts]), pids)
        if any(p.custom is not None for p in parts):
            out.custom = [m for p in parts for m in p.custom_list()]
        if any(p.backend is not None for p in parts):
            out.backend = [m for p in parts for m in p.backend_list()]
        return out

    def groups(self) -> list[tuple[str, np.ndarray, np.ndarray | None]]:
        """``(partition, global indexes, positions in the batch or None for all)``."""
        if isinstance(self.partition, str):
            return [(self.partition, self.indexes, None)]
        groups: dict[str, list[int]] = {}
        for pos, pid in enumerate(self.partition):
            groups.setdefault(pid, []).append(pos)
        return [(pid, self.indexes[np.array(p)], np.array(p)) for pid, p in groups.items()]
