"""A storage unit: holds the payload of the samples placed on it, column by column.

A put's columns are kept as they arrived: over ipc:// they are views of the
producer's shared memory, so storing copies nothing. A read of rows that are
contiguous in one stored column returns a view of it (sent on without a
copy); other selections are gathered once into warm shared memory.

No process-global state: it can run in a thread, a child process or a Ray actor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ._columns import take
from ._errors import SchemaError

__all__ = ["StorageUnit"]


class _Chunk:
    """One stored column: the rows one put placed on this unit for one field."""

    __slots__ = ("column", "live", "nbytes")

    def __init__(self, column: Any, rows: int) -> None:
        self.column = column
        self.live = rows
        self.nbytes = _nbytes(column)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list):
        return sum(_nbytes(v) for v in value)
    if hasattr(value, "nbytes"):
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
            chunk = _Chunk(column, len(indexes))
            where = self.where.setdefault(name, {})
            for row, index in enumerate(indexes):
                old = where.get(index)
                if old is not None:
                    self._unref(old[0])
                where[index] = (chunk, row)
            self.bytes_held += chunk.nbytes
            self.bytes_in += chunk.nbytes
        return len(indexes)

    def _unref(self, chunk: _Chunk) -> None:
        chunk.live -= 1
        if chunk.live == 0:
            self.bytes_held -= chunk.nbytes

    def read(self, indexes: list[int], fields: list[str]) -> dict[str, Any]:
        out = {}
        for name in fields:
            where = self.where.get(name, {})
            parts: list[tuple[Any, list[int]]] = []
            for index in indexes:
                entry = where.get(index)
                if entry is None:
                    raise SchemaError(
                        f"field `{name}`: sample {index} has no value on this storage unit "
                        "(it was dropped, or never put)"
                    )
                chunk, row = entry
                if parts and parts[-1][0] is chunk.column:
                    parts[-1][1].append(row)
                else:
                    parts.append((chunk.column, [row]))
            value = take(parts)
            self.bytes_out += _nbytes(value)
            out[name] = value
        return out

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
