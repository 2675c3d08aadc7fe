"""A storage unit: holds the payload of the samples placed on it, column by column.

A put's columns are kept as they arrived: over ipc:// they are views of the
producer's shared memory, so storing copies nothing. A read of rows that are
contiguous in one stored column returns a view of it (sent on without a
copy); other selections are gathered once into warm shared memory.

No process-global state: it can run in a thread, a child process or a Ray actor.
"""

from __future__ import annotations

import bisect
import time
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from rlferry.wire.lowlevel import AsyncResource, brief

from .._columns import nbytes, rows_of, take
from .._errors import QueueClosed, SchemaError
from .._messages import Drop, Dump, Load, Put, Read, Stats, storage_request
from ..statistics import StorageStatistics

__all__ = ["StorageUnit", "Stored"]

Stored = Callable[[str, list[int], list[str]], Awaitable[None]]


class _Chunk:
    """One stored column: the rows one put placed on this unit for one field."""

    __slots__ = ("column", "live", "nbytes", "rows")

    def __init__(self, column: Any, rows: int) -> None:
        self.column = column
        self.rows = rows
        self.live = rows
        self.nbytes = nbytes(column)


def _runs(indexes: list[int]) -> list[tuple[int, int, int]]:
    """``(start, stop, row)``: runs of consecutive indexes and the position of each run's
    start in ``indexes``."""
    if indexes and indexes == list(range(indexes[0], indexes[0] + len(indexes))):
        return [(indexes[0], indexes[0] + len(indexes), 0)]  # the usual case, at C speed
    out: list[tuple[int, int, int]] = []
    for row, index in enumerate(indexes):
        if out and out[-1][1] == index:
            out[-1] = (out[-1][0], index + 1, out[-1][2])
        else:
            out.append((index, index + 1, row))
    return out


class _Field:
    """Where one field's rows are: sorted, disjoint runs ``[start, stop)`` of sample
    indexes, each a run of rows of one chunk. A put of consecutive indexes is one run,
    so bookkeeping costs per put, not per sample."""

    __slots__ = ("runs", "starts")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.runs: list[tuple[int, int, _Chunk, int]] = []  # (start, stop, chunk, first row)

    def cut(self, a: int, b: int, release: Callable[[_Chunk, int], None]) -> int:
        """Forget indexes ``[a, b)``; returns how many were held."""
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        removed = 0
        while i < len(self.runs) and self.runs[i][0] < b:
            start, stop, chunk, row = self.runs[i]
            if stop <= a:
                i += 1
                continue
            lo, hi = max(start, a), min(stop, b)
            release(chunk, hi - lo)
            removed += hi - lo
            keep = []
            if start < lo:
                keep.append((start, lo, chunk, row))
            if hi < stop:
                keep.append((hi, stop, chunk, row + hi - start))
            self.runs[i : i + 1] = keep
            self.starts[i : i + 1] = [k[0] for k in keep]
            i += len(keep)
        return removed

    def add(self, a: int, b: int, chunk: _Chunk, row: int) -> None:
        i = bisect.bisect_left(self.starts, a)
        self.runs.insert(i, (a, b, chunk, row))
        self.starts.insert(i, a)

    def whole(self, a: int, b: int) -> _Chunk | None:
        """The chunk that is exactly indexes ``[a, b)``, all its rows (a read of one put)."""
        i = bisect.bisect_right(self.starts, a) - 1
        if i < 0:
            return None
        start, stop, chunk, row = self.runs[i]
        return chunk if start == a and stop == b and row == 0 and chunk.rows == b - a else None

    def pieces(self, a: int, b: int, name: str, out: list[tuple[Any, int, int]]) -> None:
        """Append ``(column, first row, stop row)`` pieces holding indexes ``[a, b)``."""
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        at = a
        while at < b:
            run = self.runs[i] if i < len(self.runs) else None
            if run is None or run[0] > at:
                raise SchemaError(
                    f"field `{name}`: sample {at} has no value on this storage unit "
                    "(it was dropped, or never put)"
                )
            start, stop, chunk, row = run
            if stop <= at:
                i += 1
                continue
            hi = min(stop, b)
            r0, r1 = row + at - start, row + hi - start
            last = out[-1] if out else None
            if last is not None and last[0] is chunk.column and last[2] == r0:
                out[-1] = (chunk.column, last[1], r1)
            else:
                out.append((chunk.column, r0, r1))
            at = hi
            i += 1

    def indexes(self) -> list[int]:
        return [i for start, stop, _, _ in self.runs for i in range(start, stop)]


class StorageUnit(AsyncResource):
    """The payload of a shard of samples; ``handle`` is its wire handler.

    It holds no socket: ``await aclose()`` (idempotent) lets go of the payload, and a
    request after that raises :class:`QueueClosed`.
    """

    def __init__(self, on_stored: Stored | None = None) -> None:
        self.on_stored = on_stored  # tells the controller which samples now have which fields
        self.fields: dict[str, _Field] = {}
        self.bytes_held = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.started = time.monotonic()
        self._closed = False

    async def handle(self, value: Any, peer: bytes) -> Any:
        """The wire handler: a typed request, checked whole, then served."""
        if self._closed:
            raise QueueClosed("this storage unit is closed")
        msg = storage_request(value)
        if isinstance(msg, Read):
            return self.read(msg.indexes, msg.fields)
        if isinstance(msg, Put):
            return await self.put(msg.partition, msg.indexes, msg.columns)
        if isinstance(msg, Drop):
            return self.drop(msg.indexes)
        if isinstance(msg, Stats):
            return msgspec.to_builtins(self.statistics())
        if isinstance(msg, Dump):
            return self.dump()
        assert isinstance(msg, Load)
        return self.load(msg.fields)

    async def put(self, partition: str, indexes: list[int], columns: dict[str, Any]) -> int:
        """Store a put's rows, then make them visible at the controller: a put is
        complete (and its producer may die) once this returns."""
        if self.on_stored is None:
            raise SchemaError("storage: this unit is not linked to a controller (cannot publish)")
        for name, column in columns.items():
            try:
                n = rows_of(column)
            except (AttributeError, TypeError, IndexError):
                n = -1
            if n != len(indexes):
                raise SchemaError(
                    f"field `{name}`: expected a column of {len(indexes)} rows (one per index), "
                    f"got {brief(column)}"
                )
        self.store(indexes, columns)
        await self.on_stored(partition, indexes, list(columns))
        return len(indexes)

    def store(self, indexes: list[int], columns: dict[str, Any]) -> int:
        placed = _runs(indexes)
        for name, column in columns.items():
            chunk = _Chunk(column, len(indexes))
            field = self.fields.get(name)
            if field is None:
                field = self.fields[name] = _Field()
            for a, b, row in placed:
                if field.runs and a < field.runs[-1][1]:  # a field put again: old rows go
                    field.cut(a, b, self._release)
                field.add(a, b, chunk, row)
            self.bytes_held += chunk.nbytes
            self.bytes_in += chunk.nbytes
        return len(indexes)

    def _release(self, chunk: _Chunk, rows: int) -> None:
        chunk.live -= rows
        if chunk.live == 0:
            self.bytes_held -= chunk.nbytes

    def read(self, indexes: list[int], fields: list[str]) -> dict[str, Any]:
        out = {}
        index_runs = _runs(indexes)  # once for all fields
        first, stop, _ = index_runs[0] if len(index_runs) == 1 else (0, 0, 0)
        for name in fields:
            field = self.fields.get(name) or _Field()
            chunk = field.whole(first, stop) if stop else None
            if chunk is not None:  # the usual read: the rows of one put, as they came
                out[name] = chunk.column
                self.bytes_out += chunk.nbytes
                continue
            pieces: list[tuple[Any, int, int]] = []
            for a, b, _ in index_runs:
                field.pieces(a, b, name, pieces)
            value = take(pieces)
            self.bytes_out += nbytes(value)
            out[name] = value
        return out

    def drop(self, indexes: list[int]) -> int:
        index_runs = _runs(sorted(indexes))
        return sum(
            field.cut(a, b, self._release)
            for field in self.fields.values()
            for a, b, _ in index_runs
        )

    def statistics(self) -> StorageStatistics:
        """Bytes held, in and out, their rates since the unit started, samples held."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return StorageStatistics(
            bytes_held=self.bytes_held,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            put_bytes_per_s=self.bytes_in / elapsed,
            get_bytes_per_s=self.bytes_out / elapsed,
            samples=len({i for f in self.fields.values() for i in f.indexes()}),
        )

    def stats(self) -> dict[str, Any]:
        """Deprecated: :meth:`statistics` (a frozen record)."""
        warnings.warn(
            "StorageUnit.stats() is deprecated: use StorageUnit.statistics() (a frozen record)",
            DeprecationWarning,
            stacklevel=2,
        )
        return dict(msgspec.to_builtins(self.statistics()))

    def dump(self) -> dict[str, Any]:
        """Every held value, per field: ``{field: [indexes, rows]}`` (for save)."""
        out: dict[str, Any] = {}
        for name, field in self.fields.items():
            indexes = field.indexes()
            if indexes:
                out[name] = [indexes, self.read(indexes, [name])[name]]
        return out

    def load(self, fields: dict[str, Any]) -> int:
        for name, (indexes, rows) in fields.items():
            self.store(indexes, {name: rows})
        return len(fields)

    async def aclose(self) -> None:
        """Let go of every value held; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.fields.clear()
        self.bytes_held = 0
