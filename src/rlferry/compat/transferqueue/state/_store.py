"""The payload of the embedded backend: columns kept as the chunks they were put in.

Each (partition, field) is a list of chunks (one per put) and two arrays indexed
by global index: which chunk holds the sample and at which row. A put adds one
chunk and writes two array slices; a get gathers rows chunk by chunk with tensor
indexing; a clear writes -1 and frees chunks nobody points at. No Python object
per sample, except for values that are one object per sample by nature (the rows
of a nested tensor, the items of a non-tensor column).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlferry.wire import shared_empty
from rlferry.wire.files import write_file
from rlferry.wire.lowlevel import bytes_copy, copy_many

from .._errors import StorageKeyNotFoundError
from ._memory import Pool
from ._saved import read_saved, store_in, store_out
from ._values import nested, objects, pack

__all__ = ["Store"]

_DENSE, _ROWS, _OBJECTS = 0, 1, 2  # a chunk: a tensor of rows, a list of tensors, a list
_POOL = Pool()  # large buffers, used again once their tensors are gone (see _memory.py)
_empty = _POOL.empty


def _grow(a: np.ndarray, size: int, fill: int) -> np.ndarray:
    if size <= len(a):
        return a
    out = np.full(max(size, 2 * len(a), 64), fill, dtype=a.dtype)
    out[: len(a)] = a
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor, jobs: _Jobs) -> None:
    """Copy ``src`` into ``dst``: now, or as a job of bytes for one parallel copy later."""
    if bytes_copy(dst, src):
        jobs.append((dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()))
    else:
        dst.copy_(src)


class _Jobs(list[tuple[int, int, int]]):
    """The byte copies of one put or get (done in one parallel copy at its end), and where
    its buffers come from: the pool, or (a service's store) warm shared memory, which a
    reply over ipc:// sends with no further copy."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.shared = shared
        self.empty: Callable[[Any, torch.dtype], torch.Tensor] = shared_empty if shared else _empty


def _chunk_of(value: Any, jobs: _Jobs) -> tuple[int, Any]:
    """``(kind, chunk)`` of one put's column: a tensor, or a list of one value per sample
    (copied: later writes by the caller do not reach the queue; a service keeps the dense
    tensors it received as they are: nobody else holds them)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return _ROWS, [r.detach().to("cpu", copy=True) for r in value.unbind()]
        if jobs.shared and value.device.type == "cpu" and value.is_contiguous():
            return _DENSE, value.detach()
        src = value.detach().cpu()
        dst = jobs.empty(src.shape, src.dtype)
        _copy(dst, src, jobs)
        return _DENSE, dst
    if value and all(isinstance(v, torch.Tensor) for v in value):
        return _ROWS, [v.detach().to("cpu", copy=True) for v in value]
    return _OBJECTS, list(value)


class _Column:
    __slots__ = ("chunks", "kinds", "live", "rows", "where")

    def __init__(self) -> None:
        self.chunks: list[Any] = []
        self.kinds: list[int] = []
        self.live: list[int] = []
        self.where = np.full(0, -1, dtype=np.int32)
        self.rows = np.zeros(0, dtype=np.int64)

    def put(self, indexes: np.ndarray, value: Any, jobs: _Jobs) -> None:
        kind, chunk = _chunk_of(value, jobs)
        top = int(indexes.max()) + 1
        self.where = _grow(self.where, top, -1)
        self.rows = _grow(self.rows, top, 0)
        old = self.where[indexes]
        if (old >= 0).any():
            self._drop(old[old >= 0])
        c = len(self.chunks)
        self.chunks.append(chunk)
        self.kinds.append(kind)
        self.live.append(len(indexes))
        self.where[indexes] = c
        self.rows[indexes] = np.arange(len(indexes))

    def _drop(self, chunks: np.ndarray) -> None:
        counts = np.bincount(chunks, minlength=len(self.live))
        for c in np.flatnonzero(counts).tolist():
            self.live[c] -= int(counts[c])
            if self.live[c] == 0:
                self.chunks[c] = None  # its memory goes now

    def clear(self, indexes: np.ndarray) -> None:
        indexes = indexes[indexes < len(self.where)]
        held = self.where[indexes]
        self._drop(held[held >= 0])
        self.where[indexes] = -1

    def holds(self, indexes: np.ndarray) -> np.ndarray:
        inside = indexes < len(self.where)
        out = np.zeros(len(indexes), dtype=bool)
        out[inside] = self.where[indexes[inside]] >= 0
        return out

    def get(self, field: str, indexes: np.ndarray, jobs: _Jobs) -> Any:
        held = self.holds(indexes)
        if not held.all():
            missing = indexes[~held][:8].tolist()
            raise StorageKeyNotFoundError(
                f"field `{field}`: expected a value for every requested sample, got none for "
                f"global indexes {missing} (cleared, or never put: check the BatchMeta's "
                "production status before get_data)"
            )
        where, rows = self.where[indexes], self.rows[indexes]
        first = int(where[0])
        if (where == first).all():
            return self._one(first, rows, jobs)
        chunks = np.flatnonzero(np.bincount(where)).tolist()
        if all(self.kinds[c] == _DENSE for c in chunks):
            parts = [self.chunks[c] for c in chunks]
            if len({(p.dtype, p.shape[1:]) for p in parts}) == 1:
                out = jobs.empty((len(indexes), *parts[0].shape[1:]), parts[0].dtype)
                for c in chunks:
                    at = np.flatnonzero(where == c)
                    out[torch.from_numpy(at)] = self.chunks[c][torch.from_numpy(rows[at])]
                return nested(out)
        return pack([self._row(int(c), int(r)) for c, r in zip(where, rows, strict=True)])

    def _one(self, c: int, rows: np.ndarray, jobs: _Jobs) -> Any:
        chunk, kind = self.chunks[c], self.kinds[c]
        n = len(rows)
        contiguous = n == 1 or (rows[-1] - rows[0] == n - 1 and bool((np.diff(rows) == 1).all()))
        if kind == _DENSE:
            out = jobs.empty((n, *chunk.shape[1:]), chunk.dtype)
            if contiguous:
                _copy(out, chunk[int(rows[0]) : int(rows[0]) + n], jobs)
            else:
                torch.index_select(chunk, 0, torch.from_numpy(rows), out=out)
            return nested(out)
        pick = chunk[int(rows[0]) : int(rows[0]) + n] if contiguous else [chunk[r] for r in rows]
        if kind == _ROWS:
            return pack([r.clone() for r in pick])
        return objects(pick)

    def _row(self, c: int, r: int) -> Any:
        chunk = self.chunks[c]
        return chunk[r].clone() if self.kinds[c] == _DENSE else chunk[r]


class Store:
    """Columns per partition, in this process. Thread-safe.

    ``shared``: the store of a service, whose puts arrive decoded from the wire and whose
    gets go back over it: it keeps a put's dense tensors as they came (no copy), and
    gathers a get into warm shared memory (sent over ipc:// with no further copy)."""

    def __init__(self, shared: bool = False) -> None:
        self._lock = threading.Lock()
        self._parts: dict[str, dict[str, _Column]] = {}
        self._shared = shared

    def put(self, partition: str, indexes: np.ndarray, data: dict[str, Any]) -> None:
        jobs = _Jobs(self._shared)
        with self._lock:
            columns = self._parts.setdefault(partition, {})
            for name, value in data.items():
                columns.setdefault(name, _Column()).put(indexes, value, jobs)
            copy_many(jobs)  # the put's large columns in one copy, on every core

    def get(self, partition: str, indexes: np.ndarray, fields: list[str]) -> dict[str, Any]:
        with self._lock:
            columns = self._parts.get(partition, {})
            out: dict[str, Any] = {}
            jobs = _Jobs(self._shared)
            for name in fields:
                column = columns.get(name)
                if column is None:
                    raise StorageKeyNotFoundError(
                        f"field `{name}`: expected it in partition `{partition}`, got a "
                        f"partition without it (it holds {sorted(columns)})"
                    )
                out[name] = column.get(name, indexes, jobs)
            copy_many(jobs)  # fills the results made above (views of their buffers)
            return out

    def clear(self, partition: str, indexes: np.ndarray) -> None:
        with self._lock:
            for column in self._parts.get(partition, {}).values():
                column.clear(indexes)

    def drop(self, partition: str) -> None:
        with self._lock:
            self._parts.pop(partition, None)

    def state(self) -> dict[str, Any]:
        """Everything held, for a checkpoint: per partition and field, the chunks and arrays."""
        with self._lock:
            return {
                pid: {
                    name: {
                        "chunks": c.chunks,
                        "kinds": c.kinds,
                        "live": c.live,
                        "where": c.where,
                        "rows": c.rows,
                    }
                    for name, c in cols.items()
                }
                for pid, cols in self._parts.items()
            }

    def save(self, path: str) -> None:
        """Write ``state()`` to the local file ``path`` (a checkpoint, in rlferry's checked
        format: nothing pickled; a value the wire does not carry is refused, naming it)."""
        write_file(path, store_out(self.state()))

    def load_from(self, path: str, trust_pickle: bool = False) -> None:
        """``load`` the local file ``save`` wrote; a pickle (TransferQueue's own format) only
        with ``trust_pickle``.

        Raises:
            FileFormatError: the file is not whole, or a pickle without ``trust_pickle``.
        """
        saved, pickled = read_saved(path, trust_pickle)
        self.load(saved if pickled else store_in(saved))

    def load(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._parts = {}
            for pid, cols in state.items():
                self._parts[pid] = {}
                for name, s in cols.items():
                    c = _Column()
                    c.chunks, c.kinds = s["chunks"], s["kinds"]
                    c.live, c.where, c.rows = s["live"], s["where"], s["rows"]
                    self._parts[pid][name] = c
