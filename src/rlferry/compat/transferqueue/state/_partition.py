"""A partition's state as arrays indexed by global index, and the global index allocator."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import numpy as np

__all__ = ["Field", "Indexes", "Partition"]

log = logging.getLogger("rlferry.compat.transferqueue")

NONE = np.array(None, dtype=object)
"""``None`` as an array, for element-wise tests of ``Partition.key_at``."""
NO_KEYS = np.full(0, None, dtype=object)
FEW = 8
"""Batches of at most this many keys are dropped one by one (array calls cost more there)."""


def _grow(a: np.ndarray, size: int) -> np.ndarray:
    if size <= len(a):
        return a
    out = np.zeros(max(size, 2 * len(a), 64), dtype=a.dtype)
    out[: len(a)] = a
    return out


class Field:
    """One field's schema in a partition; per-sample shapes only once it is nested."""

    __slots__ = ("dtype", "is_nested", "is_non_tensor", "shape", "shapes")

    def __init__(self) -> None:
        self.dtype: Any = None
        self.shape: Any = None
        self.is_nested: bool | None = None
        self.is_non_tensor: bool | None = None
        self.shapes: dict[int, tuple[int, ...]] = {}

    def update(
        self, name: str, incoming: dict[str, Any], indexes: np.ndarray, had: np.ndarray
    ) -> None:
        """Take in one put's schema for ``indexes``; ``had`` are the samples held before.
        A dtype that differs from the field's is stored (as TransferQueue does) with a warning;
        the schema keeps the first dtype."""
        new = incoming.get("dtype")
        if new is not None and self.dtype is not None and new != self.dtype:
            log.warning(
                "field `%s`: expected dtype %s (as earlier puts of the partition), got %s: "
                "stored, but batches mixing both are not one tensor (cast the column)",
                name,
                self.dtype,
                new,
            )
        elif new is not None:
            self.dtype = new
        if incoming.get("is_non_tensor"):
            self.is_non_tensor, self.is_nested = True, False
            return
        self.is_non_tensor = False
        shapes = incoming.get("per_sample_shapes")
        if incoming.get("is_nested"):
            if self.is_nested is False and self.shape is not None:
                self.shapes.update(dict.fromkeys(had.tolist(), tuple(self.shape)))
            self.is_nested, self.shape = True, None
            self.shapes.update(zip(indexes.tolist(), shapes or (), strict=True))
            return
        shape = tuple(incoming.get("shape") or ())
        if self.is_nested:
            self.shapes.update(dict.fromkeys(indexes.tolist(), shape))
        elif self.shape is not None and tuple(self.shape) != shape and len(had):
            self.shapes.update(dict.fromkeys(had.tolist(), tuple(self.shape)))
            self.shapes.update(dict.fromkeys(indexes.tolist(), shape))
            self.is_nested, self.shape = True, None
        else:
            self.is_nested, self.shape = False, incoming.get("shape")

    def schema(self, indexes: np.ndarray) -> dict[str, Any]:
        out = {
            "dtype": self.dtype,
            "shape": self.shape,
            "is_nested": self.is_nested,
            "is_non_tensor": self.is_non_tensor,
        }
        if self.is_nested and self.shapes:
            out["per_sample_shapes"] = [self.shapes.get(i) for i in indexes.tolist()]
        return out


class Partition:
    """One partition: which global indexes it holds, what each has produced and each task
    consumed (boolean arrays by global index), fields' schemas, custom meta and keys.

    Keys: ``keys`` maps a key to its global index (a dict, read and written a batch at a
    time by C-level ``map``/``zip``, no Python loop per key), ``key_at`` the other way (an
    object array by global index, ``None`` where none)."""

    def __init__(self, pid: str) -> None:
        self.id = pid
        self.members = np.zeros(0, dtype=bool)  # active samples, by global index
        self.pre: list[int] = []  # pre-allocated indexes, not active yet
        self.produced: dict[str, np.ndarray] = {}
        self.consumed: dict[str, np.ndarray] = {}
        self.fields: dict[str, Field] = {}
        self.custom: dict[int, dict[str, Any]] = {}
        self.keys: dict[str, int] = {}
        self.key_at = NO_KEYS  # replaced, not written, when it grows

    def __setstate__(self, state: dict[str, Any]) -> None:
        key_of = state.pop("key_of", None)  # pickled by a shim that kept a dict of them
        self.__dict__.update(state)
        if key_of is not None:
            self.set_keys(self.keys)

    def ensure(self, size: int) -> None:
        self.members = _grow(self.members, size)
        for name, a in self.produced.items():
            self.produced[name] = _grow(a, size)
        for task, a in self.consumed.items():
            self.consumed[task] = _grow(a, size)

    # ---- keys ----
    def find(self, keys: Sequence[str]) -> np.ndarray:
        """The global index of each key, -1 for keys the partition does not hold."""
        if not self.keys:
            return np.full(len(keys), -1, dtype=np.int64)
        return np.fromiter(map(self.keys.get, keys, repeat(-1)), np.int64, len(keys))

    def name(self, keys: Sequence[str], indexes: np.ndarray) -> bool:
        """Give ``indexes`` the ``keys`` (one each, none held yet). False if a key came twice:
        then it names the last of its indexes, and the others have none."""
        size = int(indexes.max()) + 1
        if size > len(self.key_at):
            grown = np.empty(max(size, 2 * len(self.key_at), 64), dtype=object)  # all None
            grown[: len(self.key_at)] = self.key_at
            self.key_at = grown
        self.key_at[indexes] = np.array(keys, dtype=object)
        held = len(self.keys)
        self.keys.update(zip(keys, indexes.tolist(), strict=True))
        if len(self.keys) - held == len(keys):
            return True
        self.key_at[indexes[self.find(keys) != indexes]] = None
        return False

    def unname(self, indexes: np.ndarray) -> None:
        """Drop the keys of ``indexes`` (those that have one)."""
        if len(indexes) <= FEW:
            for i in indexes.tolist():
                key = self.key_at[i] if i < len(self.key_at) else None
                if key is not None:
                    self.key_at[i] = None
                    del self.keys[key]
            return
        indexes = indexes[indexes < len(self.key_at)]
        named = self.key_at[indexes]
        named = named[np.not_equal(named, NONE)]
        if len(named):
            self.key_at[indexes] = None
            deque(map(self.keys.pop, named.tolist()), maxlen=0)

    def keys_of(self, indexes: np.ndarray) -> list[str] | None:
        """The keys of ``indexes``; None if one of them has none."""
        if len(indexes) and (indexes.min() < 0 or indexes.max() >= len(self.key_at)):
            return None
        named = self.key_at[indexes]
        return None if np.equal(named, NONE).any() else named.tolist()

    def set_keys(self, keys: dict[str, int]) -> None:
        """Hold exactly ``keys`` (key -> global index)."""
        self.keys, self.key_at = {}, NO_KEYS
        if keys:
            self.name(list(keys), np.fromiter(keys.values(), np.int64, len(keys)))

    def indexes(self) -> np.ndarray:
        """Every index of the partition, pre-allocated ones included, sorted."""
        if not self.pre:
            return np.flatnonzero(self.members)
        mask = self.members.copy()
        mask[self.pre] = True
        return np.flatnonzero(mask)

    def consumed_of(self, task: str) -> np.ndarray:
        if task not in self.consumed:
            self.consumed[task] = np.zeros(len(self.members), dtype=bool)
        return self.consumed[task]

    def ready(self, fields: list[str], task: str) -> np.ndarray:
        if any(f not in self.produced for f in fields):
            return np.zeros(0, dtype=np.int64)
        mask = self.members.copy() if not fields else self.produced[fields[0]].copy()
        for f in fields[1:]:
            mask &= self.produced[f]
        mask &= ~self.consumed_of(task)
        return np.flatnonzero(mask)

    def status(self, indexes: np.ndarray, fields: list[str]) -> np.ndarray:
        """1 where every one of ``fields`` is produced, per sample."""
        ok = np.ones(len(indexes), dtype=bool)
        inside = indexes < len(self.members)
        for f in fields:
            col = self.produced.get(f)
            if col is None:
                return np.zeros(len(indexes), dtype=np.int8)
            ok[inside] &= col[indexes[inside]]
        ok[~inside] = False
        return ok.astype(np.int8)

    def get_custom_meta(self, global_indices: Any) -> dict[int, dict[str, Any]]:
        """The samplers' view: ``{index: custom meta}`` of those that have one."""
        return {i: self.custom[i] for i in global_indices if i in self.custom}

    def custom_list(self, indexes: np.ndarray) -> list[dict[str, Any]] | None:
        if not self.custom:
            return None
        return [dict(self.custom.get(i, {})) for i in indexes.tolist()]


class Indexes:
    """Global indexes: freed ones first (oldest first), then new ones."""

    def __init__(self) -> None:
        self.next = 0
        self.free: list[np.ndarray] = []

    def take(self, n: int) -> np.ndarray:
        parts, need = [], n
        while need and self.free:
            head = self.free[0]
            parts.append(head[:need])
            if len(head) <= need:
                self.free.pop(0)
            else:
                self.free[0] = head[need:]
            need -= len(parts[-1])
        if need:
            parts.append(np.arange(self.next, self.next + need, dtype=np.int64))
            self.next += need
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def give(self, indexes: np.ndarray) -> None:
        if len(indexes):
            self.free.append(np.asarray(indexes, dtype=np.int64))
