"""The embedded controller: TransferQueue's metadata (partitions, global indexes,
production and consumption status, field schema, custom meta, keys) as arrays.

Per partition, one boolean array per field (produced) and per task (consumed),
indexed by global index; finding the ready samples of a ``get_meta`` is a few
vectorized operations, not a loop over samples. A ``get_meta`` that finds too few
waits on an event (a condition variable for threads, a future for asyncio) that
every put sets, so it returns the moment data lands; in ``polling_mode`` it
returns an empty ``BatchMeta`` at once instead, as TransferQueue does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from ._errors import GetMetaTimeout
from ._meta import BatchMeta
from ._samplers import BaseSampler, SequentialSampler

__all__ = ["Controller"]

log = logging.getLogger("rlferry.compat.transferqueue")
T = TypeVar("T")
_MODES = ("fetch", "force_fetch", "insert")


def _grow(a: np.ndarray, size: int) -> np.ndarray:
    if size <= len(a):
        return a
    out = np.zeros(max(size, 2 * len(a), 64), dtype=a.dtype)
    out[: len(a)] = a
    return out


class _Field:
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


class _Partition:
    def __init__(self, pid: str) -> None:
        self.id = pid
        self.members = np.zeros(0, dtype=bool)  # active samples, by global index
        self.pre: list[int] = []  # pre-allocated indexes, not active yet
        self.produced: dict[str, np.ndarray] = {}
        self.consumed: dict[str, np.ndarray] = {}
        self.fields: dict[str, _Field] = {}
        self.custom: dict[int, dict[str, Any]] = {}
        self.keys: dict[str, int] = {}
        self.key_of: dict[int, str] = {}

    def ensure(self, size: int) -> None:
        self.members = _grow(self.members, size)
        for name, a in self.produced.items():
            self.produced[name] = _grow(a, size)
        for task, a in self.consumed.items():
            self.consumed[task] = _grow(a, size)

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


class _Indexes:
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


class Controller:
    """Partitions and their status, in this process. Thread-safe; waits are event-driven."""

    def __init__(
        self, *, sampler: BaseSampler, polling_mode: bool, timeout: float, pre_alloc: int
    ) -> None:
        self.sampler = sampler
        self.polling_mode = polling_mode
        self.timeout = timeout
        self.pre_alloc = pre_alloc
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._parts: dict[str, _Partition] = {}
        self._indexes = _Indexes()
        self._version = 0  # counts changes, for waiters that wait for the next one

    # ---- waiting ----
    def _notify(self) -> None:
        """Data changed: wake every waiting get_meta (called with the lock held)."""
        self._version += 1
        self._changed.notify_all()
        for loop, fut in self._futures:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_wake, fut)
        self._futures.clear()

    def wait_for(self, attempt: Callable[[], T | None], what: Callable[[], str]) -> T:
        """``attempt()`` under the lock until it answers, waiting for puts in between."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while True:
                got = attempt()
                if got is not None:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
        raise GetMetaTimeout(what())

    def version(self) -> int:
        with self._lock:
            return self._version

    def wait_change(self, seen: int) -> None:
        """Wait until something changed since ``version()`` was ``seen`` (or the get_meta
        timeout passed: the caller looks again either way)."""
        with self._lock:
            self._changed.wait_for(lambda: self._version != seen, self.timeout)

    async def async_wait_for(self, attempt: Callable[[], T | None], what: Callable[[], str]) -> T:
        deadline = time.monotonic() + self.timeout
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                got = attempt()
                if got is not None:
                    return got
                fut: asyncio.Future[None] = loop.create_future()
                self._futures.append((loop, fut))
            left = deadline - time.monotonic()
            try:
                if left > 0:
                    await asyncio.wait([fut], timeout=left)
            finally:  # timed out or cancelled: no put should wake a loop that may be gone
                with self._lock:
                    if (loop, fut) in self._futures:
                        self._futures.remove((loop, fut))
            if left <= 0:
                raise GetMetaTimeout(what())

    # ---- partitions ----
    def _partition(self, pid: str, create: bool = False) -> _Partition | None:
        part = self._parts.get(pid)
        if part is None and create:
            part = self._parts[pid] = _Partition(pid)
            if self.pre_alloc > 0:
                pre = self._indexes.take(self.pre_alloc)
                part.pre = pre.tolist()
                part.ensure(int(pre.max()) + 1)
        return part

    def _allocate(self, part: _Partition, n: int) -> np.ndarray:
        pre = part.pre[:n]
        del part.pre[: len(pre)]
        new = self._indexes.take(n - len(pre)) if n > len(pre) else np.zeros(0, dtype=np.int64)
        indexes = np.concatenate([np.array(pre, dtype=np.int64), new]) if pre else new
        part.ensure(int(indexes.max()) + 1)
        part.members[indexes] = True
        return indexes

    def partitions(self) -> list[str]:
        with self._lock:
            return list(self._parts)

    def _meta(
        self, part: _Partition, indexes: np.ndarray, fields: list[str], status: np.ndarray
    ) -> BatchMeta:
        schema = {f: part.fields[f].schema(indexes) for f in fields if f in part.fields}
        return BatchMeta._of(indexes, part.id, schema, status, part.custom_list(indexes))

    # ---- get_meta ----
    def insert(self, pid: str, fields: list[str], n: int) -> BatchMeta:
        with self._lock:
            part = self._partition(pid, create=True)
            assert part is not None
            indexes = self._allocate(part, n)
            meta = self._meta(part, indexes, fields, np.zeros(n, dtype=np.int8))
            for f in fields:
                meta.field_schema.setdefault(
                    f, {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": False}
                )
            return meta

    def fetch_attempt(
        self, pid: str, fields: list[str], n: int, task: str, config: dict[str, Any]
    ) -> BatchMeta | None:
        """One try of a fetch (lock held): a BatchMeta, an empty one (polling), or None (wait)."""
        part = self._parts.get(pid)
        ready = part.ready(fields, task) if part is not None else np.zeros(0, dtype=np.int64)
        if len(ready) < n and not self.sampler.has_cached_result(pid, task, config):
            return BatchMeta.empty() if self.polling_mode else None
        if part is None:
            return None
        if type(self.sampler) is SequentialSampler:
            sampled = consumed = ready[:n]
        else:
            s, c = self.sampler(ready.tolist(), n, partition=part, **config)
            sampled = np.asarray(s, dtype=np.int64)
            consumed = np.asarray(c, dtype=np.int64)
        if len(sampled) == 0:
            if self.polling_mode:
                return BatchMeta.empty()
            raise RuntimeError(
                f"get_meta `{pid}` for task `{task}`: expected the sampler "
                f"{type(self.sampler).__name__} to choose from {len(ready)} ready samples, got "
                f"none (for grouped samplers: are whole groups ready? Sampler returned no samples)"
            )
        if len(consumed):
            part.consumed_of(task)[consumed] = True
        return self._meta(part, sampled, fields, np.ones(len(sampled), dtype=np.int8))

    def force_fetch(self, pid: str, fields: list[str]) -> BatchMeta:
        with self._lock:
            part = self._parts.get(pid)
            if part is None:
                return BatchMeta.empty()
            indexes = part.indexes()
            return self._meta(part, indexes, fields, part.status(indexes, fields))

    def fetch_timeout(self, pid: str, fields: list[str], n: int, task: str) -> str:
        with self._lock:
            part = self._parts.get(pid)
            if part is None:
                return (
                    f"get_meta: expected partition `{pid}`, got no such partition after waiting "
                    f"{self.timeout:g} s (partitions: {sorted(self._parts)}; a misspelled "
                    "partition_id, or no put yet)"
                )
            ready = len(part.ready(fields, task))
            missing = [f for f in fields if f not in part.produced]
            hint = (
                f"no put brought fields {missing}: a misspelled field?"
                if missing
                else "wait longer (controller.get_meta_timeout), or ask for fewer"
            )
            return (
                f"get_meta `{pid}` for task `{task}`: expected {n} ready samples with fields "
                f"{fields}, got {ready} after waiting {self.timeout:g} s (Timeout while waiting "
                f"for sufficient data; the partition holds fields {sorted(part.produced)}; {hint})"
            )

    # ---- production ----
    def produced(self, pid: str, indexes: np.ndarray, schema: dict[str, dict[str, Any]]) -> None:
        with self._lock:
            part = self._partition(pid)
            if part is None:
                return  # cleared while the put ran: its data went with the partition
            part.ensure(int(indexes.max()) + 1)
            for name, incoming in schema.items():
                col = part.produced.get(name)
                if col is None:
                    col = part.produced[name] = np.zeros(len(part.members), dtype=bool)
                had = np.flatnonzero(col)
                part.fields.setdefault(name, _Field()).update(name, incoming, indexes, had)
                col[indexes] = True
            self._notify()

    def set_custom(self, pid: str, indexes: np.ndarray, custom: list[dict[str, Any]]) -> None:
        with self._lock:
            part = self._parts.get(pid)
            if part is not None:
                part.custom.update(zip(indexes.tolist(), (dict(c) for c in custom), strict=True))
                self._notify()

    # ---- status ----
    def consumption(self, pid: str, task: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        with self._lock:
            part = self._parts.get(pid)
            if part is None:
                return None, None
            indexes = part.indexes()
            part.ensure(int(indexes.max()) + 1 if len(indexes) else 0)
            status = part.consumed_of(task)[indexes].astype(np.int8)
            return torch.from_numpy(indexes), torch.from_numpy(status)

    def production(
        self, pid: str, fields: list[str]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        with self._lock:
            part = self._parts.get(pid)
            if part is None or not fields or any(f not in part.produced for f in fields):
                return None, None
            indexes = part.indexes()
            part.ensure(int(indexes.max()) + 1 if len(indexes) else 0)
            cols = [part.produced[f][indexes] for f in part.produced if f in fields]
            status = np.stack(cols, axis=1).astype(np.int8)
            return torch.from_numpy(indexes), torch.from_numpy(status)

    def reset_consumption(self, pid: str, task: str | None) -> None:
        with self._lock:
            part = self._parts.get(pid)
            if part is None:
                return
            for name, col in part.consumed.items():
                if task is None or name == task:
                    col[:] = False
            self._notify()

    # ---- clearing ----
    def partition_indexes(self, pid: str) -> np.ndarray | None:
        with self._lock:
            part = self._parts.get(pid)
            return None if part is None else part.indexes()

    def clear_samples(self, pid: str, indexes: np.ndarray) -> None:
        with self._lock:
            part = self._parts.get(pid)
            if part is None:
                return
            mask = np.zeros(len(part.members), dtype=bool)  # (np.unique hashes: far slower)
            mask[indexes[indexes < len(mask)]] = True
            indexes = np.flatnonzero(mask & part.members)
            if not len(indexes):
                return
            part.members[indexes] = False
            for col in (*part.produced.values(), *part.consumed.values()):
                col[indexes] = False
            for name in list(part.fields):
                f = part.fields[name]
                for i in indexes.tolist() if f.shapes else ():
                    f.shapes.pop(i, None)
                if not part.produced[name].any():
                    del part.fields[name]
            if part.custom:
                for i in indexes.tolist():
                    part.custom.pop(i, None)
            if part.key_of:
                for i in indexes.tolist():
                    key = part.key_of.pop(i, None)
                    if key is not None:
                        del part.keys[key]
            self._indexes.give(indexes)

    def drop(self, pid: str) -> bool:
        with self._lock:
            part = self._parts.pop(pid, None)
            if part is None:
                return False
            self._indexes.give(part.indexes())
            self.sampler.clear_cache(pid)
            return True

    # ---- keys ----
    def kv_meta(self, keys: list[str], pid: str, create: bool) -> BatchMeta:
        with self._lock:
            part = self._partition(pid, create=create)
            if part is None:
                return BatchMeta.empty()
            found = [part.keys.get(k) for k in keys]
            new = [k for k, i in zip(keys, found, strict=True) if i is None]
            if new and create:
                indexes = self._allocate(part, len(new))
                for k, i in zip(new, indexes.tolist(), strict=True):
                    part.keys[k], part.key_of[i] = i, k
                found = [part.keys.get(k) for k in keys]
            held = np.array([i for i in found if i is not None], dtype=np.int64)
            fields = [f for f, col in part.produced.items() if len(held) and col[held].all()]
            return self._meta(part, held, fields, part.status(held, fields))

    def kv_keys(self, indexes: list[int], pid: str) -> list[str]:
        with self._lock:
            part = self._parts.get(pid)
            if part is None:
                return []
            keys = [part.key_of[i] for i in indexes if i in part.key_of]
            return keys if len(keys) == len(indexes) else []

    def kv_list(self, pid: str | None) -> dict[str, dict[str, dict[str, Any]]]:
        with self._lock:
            pids = list(self._parts) if pid is None else [pid]
            return {
                p: {
                    k: dict(self._parts[p].custom.get(i, {}))
                    for k, i in self._parts[p].keys.items()
                }
                for p in pids
                if p in self._parts
            }

    # ---- checkpoints ----
    def state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "parts": self._parts,
                "next": self._indexes.next,
                "free": self._indexes.free,
                "sampler": self.sampler.save_checkpoint(),
            }

    def load(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._parts = state["parts"]
            self._indexes.next, self._indexes.free = state["next"], state["free"]
            self.sampler.load_checkpoint(state["sampler"])
            self._notify()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
