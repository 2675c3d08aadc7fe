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

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlferry.wire.files import write_file

from ..metadata import BatchMeta, from_arrays
from ..samplers import BaseSampler, SequentialSampler
from ._changes import Changes
from ._partition import Field, Indexes, Partition
from ._saved import controller_in, controller_out, read_saved

__all__ = ["Controller"]


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
        self._changes = Changes(self._lock)
        self._parts: dict[str, Partition] = {}
        self._indexes = Indexes()

    # ---- waiting ----
    def version(self) -> int:
        """How many times the data changed (for ``wait_change``)."""
        with self._lock:
            return self._changes.version

    def wait_change(self, seen: int) -> None:
        """Wait until something changed since ``version()`` was ``seen`` (or the get_meta
        timeout passed: the caller looks again either way)."""
        self._changes.wait_change(seen, self.timeout)

    async def async_wait_change(self, seen: int) -> None:
        """``wait_change`` for a caller on an event loop (a service's parked request)."""
        await self._changes.async_wait_change(seen, self.timeout)

    def fetch(
        self, pid: str, fields: list[str], n: int, task: str, config: dict[str, Any]
    ) -> BatchMeta:
        """A fetch ``get_meta``: waits (on an event, at most ``timeout`` s) for ``n`` ready
        samples and marks the chosen ones consumed by ``task``.

        Raises:
            GetMetaTimeout: too few ready samples within the timeout.
        """
        return self._changes.wait_for(*self._fetching(pid, fields, n, task, config))

    async def async_fetch(
        self, pid: str, fields: list[str], n: int, task: str, config: dict[str, Any]
    ) -> BatchMeta:
        """``fetch`` on the caller's event loop (it never blocks the loop while it waits)."""
        return await self._changes.async_wait_for(*self._fetching(pid, fields, n, task, config))

    def _fetching(
        self, pid: str, fields: list[str], n: int, task: str, config: dict[str, Any]
    ) -> tuple[Callable[[], BatchMeta | None], Callable[[], str], float]:
        return (
            lambda: self.fetch_attempt(pid, fields, n, task, config),
            lambda: self.fetch_timeout(pid, fields, n, task),
            self.timeout,
        )

    # ---- partitions ----
    def _partition(self, pid: str, create: bool = False) -> Partition | None:
        part = self._parts.get(pid)
        if part is None and create:
            part = self._parts[pid] = Partition(pid)
            if self.pre_alloc > 0:
                pre = self._indexes.take(self.pre_alloc)
                part.pre = pre.tolist()
                part.ensure(int(pre.max()) + 1)
        return part

    def _allocate(self, part: Partition, n: int) -> np.ndarray:
        pre = part.pre[:n]
        del part.pre[: len(pre)]
        new = self._indexes.take(n - len(pre)) if n > len(pre) else np.zeros(0, dtype=np.int64)
        indexes = np.concatenate([np.array(pre, dtype=np.int64), new]) if pre else new
        part.ensure(int(indexes.max()) + 1)
        part.members[indexes] = True
        return indexes

    def has(self, pid: str) -> bool:
        with self._lock:
            return pid in self._parts

    def partitions(self) -> list[str]:
        with self._lock:
            return list(self._parts)

    def _meta(
        self, part: Partition, indexes: np.ndarray, fields: list[str], status: np.ndarray
    ) -> BatchMeta:
        schema = {f: part.fields[f].schema(indexes) for f in fields if f in part.fields}
        return from_arrays(indexes, part.id, schema, status, part.custom_list(indexes))

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
            try:
                s, c = self.sampler(ready.tolist(), n, partition=part, **config)
            except Exception as e:  # TransferQueue's client reports it as a RuntimeError
                raise RuntimeError(
                    f"get_meta `{pid}` for task `{task}`: the sampler "
                    f"{type(self.sampler).__name__} raised {type(e).__name__}: {e}"
                ) from e
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
                part.fields.setdefault(name, Field()).update(name, incoming, indexes, had)
                col[indexes] = True
            self._changes.notify()

    def set_custom(self, pid: str, indexes: np.ndarray, custom: list[dict[str, Any]]) -> None:
        with self._lock:
            part = self._parts.get(pid)
            if part is not None:
                part.custom.update(zip(indexes.tolist(), (dict(c) for c in custom), strict=True))
                self._changes.notify()

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
            self._changes.notify()

    # ---- clearing ----
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
            if part.keys:
                part.unname(indexes)
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
            held = part.find(keys)
            lacking = held < 0
            if create and lacking.any():
                new = np.flatnonzero(lacking)
                names = keys if len(new) == len(keys) else np.array(keys, object)[new].tolist()
                held[new] = indexes = self._allocate(part, len(names))
                if not part.name(names, indexes):  # a key twice: one sample holds it
                    held = part.find(keys)
            elif lacking.any():
                held = held[~lacking]
            fields = [f for f, col in part.produced.items() if len(held) and col[held].all()]
            return self._meta(part, held, fields, part.status(held, fields))

    def kv_keys(self, indexes: list[int], pid: str) -> list[str]:
        with self._lock:
            part = self._parts.get(pid)
            if part is None:
                return []
            keys = part.keys_of(np.asarray(indexes, dtype=np.int64))
            return [] if keys is None else keys

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

    def save(self, path: str) -> None:
        """Write ``state()`` to the local file ``path`` (a checkpoint, in rlferry's checked
        format: nothing pickled)."""
        write_file(path, controller_out(self.state()))

    def load_from(self, path: str, trust_pickle: bool = False) -> None:
        """``load`` the local file ``save`` wrote; a pickle (TransferQueue's own format) only
        with ``trust_pickle``.

        Raises:
            FileFormatError: the file is not whole, or a pickle without ``trust_pickle``.
        """
        saved, pickled = read_saved(path, trust_pickle)
        self.load(saved if pickled else controller_in(saved))

    def load(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._parts = state["parts"]
            self._indexes.next, self._indexes.free = state["next"], state["free"]
            self.sampler.load_checkpoint(state["sampler"])
            self._changes.notify()
