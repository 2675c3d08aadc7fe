"""A storage unit: holds the payload of the samples placed on it, column by column.

A put's columns are kept as they arrived: over ipc:// they are views of the
producer's shared memory, so storing copies nothing. A read of rows that are
contiguous in one stored column returns a view of it (sent on without a
copy); other selections are gathered once into warm shared memory.

No process-global state: it can run in a thread, a child process or a Ray actor.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from ._columns import runs, take
from ._errors import SchemaError

__all__ = ["StorageUnit"]


class _Chunk:
    """One stored column: the rows one put placed on this unit for one field."""

    __slots__ = ("column", "live", "nbytes", "ordered")

    def __init__(self, column: Any, indexes: list[int]) -> None:
        self.column = column
        self.live = len(indexes)
        self.nbytes = _nbytes(column)
        # rows follow consecutive indexes: a run of indexes is a run of rows
        self.ordered = indexes == list(range(indexes[0], indexes[0] + len(indexes)))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            value = value.values()
        return value.numel() * value.element_size()
    if isinstance(value, list):
        return sum(_nbytes(v) for v in value)
    if hasattr(value, "nbytes"):  # numpy arrays, PackedStrings
        return int(value.nbytes)
    if isinstance(value, (str, bytes)):
        return len(value)
    return 8


class StorageUnit:
    """The payload of a shard of samples; ``handle`` is its wire handler."""

    def __init__(self) -> None:
        self.where: dict[str, dict[int, tuple[_Chunk, int]]] = {}  # field -> index -> (chunk, row)
        self.bytes_held = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.started = time.monotonic()
        self._ops: dict[str, Callable[..., Any]] = {
            "store": self.store,
            "read": self.read,
            "drop": self.drop,
            "stats": self.stats,
            "dump": self.dump,
            "load": self.load,
        }

    async def handle(self, value: Any, peer: bytes) -> Any:
        op, args = value
        fn = self._ops.get(op)
        if fn is None:
            raise SchemaError(f"op: expected one of {sorted(self._ops)}, got {op!r}")
        return fn(**args)

    def store(self, indexes: list[int], columns: dict[str, Any]) -> int:
        for name, column in columns.items():
            chunk = _Chunk(column, indexes)
            where = self.where.setdefault(name, {})
            if not where.keys().isdisjoint(indexes):  # a field put again: the old rows go
                for index in indexes:
                    old = where.get(index)
                    if old is not None:
                        self._unref(old[0])
            rows = zip(itertools.repeat(chunk), range(len(indexes)))
            where.update(zip(indexes, rows, strict=False))  # repeat() is endless
            self.bytes_held += chunk.nbytes
            self.bytes_in += chunk.nbytes
        return len(indexes)

    def _unref(self, chunk: _Chunk) -> None:
        chunk.live -= 1
        if chunk.live == 0:
            self.bytes_held -= chunk.nbytes

    def read(self, indexes: list[int], fields: list[str]) -> dict[str, Any]:
        out = {}
        index_runs = runs(indexes)  # once for all fields
        for name in fields:
            where = self.where.get(name, {})
            pieces: list[tuple[Any, int, int]] = []
            for a, b in index_runs:
                first, last = self._find(where, name, a), self._find(where, name, b - 1)
                if first[0] is last[0] and first[0].ordered and last[1] - first[1] == b - 1 - a:
                    self._extend(pieces, first[0].column, first[1], last[1] + 1)
                    continue
                for index in range(a, b):  # rows of several puts, or added out of order
                    chunk, row = self._find(where, name, index)
                    self._extend(pieces, chunk.column, row, row + 1)
            value = take(pieces)
            self.bytes_out += _nbytes(value)
            out[name] = value
        return out

    @staticmethod
    def _find(where: dict[int, tuple[_Chunk, int]], name: str, index: int) -> tuple[_Chunk, int]:
        entry = where.get(index)
        if entry is None:
            raise SchemaError(
                f"field `{name}`: sample {index} has no value on this storage unit "
                "(it was dropped, or never put)"
            )
        return entry

    @staticmethod
    def _extend(pieces: list[tuple[Any, int, int]], column: Any, a: int, b: int) -> None:
        if pieces and pieces[-1][0] is column and pieces[-1][2] == a:
            pieces[-1] = (column, pieces[-1][1], b)
        else:
            pieces.append((column, a, b))

    def drop(self, indexes: list[int]) -> int:
        dropped = 0
        for where in self.where.values():
            for index in indexes:
                entry = where.pop(index, None)
                if entry is not None:
                    self._unref(entry[0])
                    dropped += 1
        return dropped

    def stats(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return {
            "bytes_held": self.bytes_held,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "put_bytes_per_s": self.bytes_in / elapsed,
            "get_bytes_per_s": self.bytes_out / elapsed,
            "samples": len({i for w in self.where.values() for i in w}),
        }

    def dump(self) -> dict[str, Any]:
        """Every held value, per field: ``{field: [indexes, rows]}`` (for save)."""
        out: dict[str, Any] = {}
        for name, where in self.where.items():
            indexes = sorted(where)
            if indexes:
                out[name] = [indexes, self.read(indexes, [name])[name]]
        return out

    def load(self, fields: dict[str, Any]) -> int:
        for name, (indexes, rows) in fields.items():
            self.store(indexes, {name: rows})
        return len(fields)
