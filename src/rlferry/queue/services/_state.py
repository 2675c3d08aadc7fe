"""The controller's state: samples, partitions and leases, and what a partition answers
about itself (its fields, its statistics, its saved form)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._errors import SchemaError
from ..statistics import PartitionStatistics, TaskStatistics

__all__ = ["Lease", "Leases", "Partition", "Sample", "describe", "ready_samples"]

_NO_FIELDS: frozenset[str] = frozenset()


class Sample:
    __slots__ = ("consumed", "fields", "index", "leased", "meta", "unit")

    def __init__(self, index: int, unit: int, meta: dict[str, Any]) -> None:
        self.index = index
        self.unit = unit
        self.fields: frozenset[str] = _NO_FIELDS  # shared among samples with the same fields
        self.meta = meta
        self.consumed: set[str] = set()
        self.leased: dict[str, int] = {}  # task -> lease id


@dataclass
class Lease:
    id: int
    partition: str
    task: str
    key: tuple[int, int, int]  # (dp_size, dp_rank, batch number)
    indexes: list[int]
    timer: asyncio.TimerHandle | None = None


@dataclass
class Partition:
    name: str
    samples: dict[int, Sample] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    signatures: dict[str, list[Any]] = field(default_factory=dict)
    shares: dict[tuple[str, int, int, int], Lease] = field(default_factory=dict)
    gets: int = 0

    def add(self, first: int, rows: int, unit: int) -> list[int]:
        """New samples ``first, first + 1, ...`` (``rows`` of them) held by ``unit``."""
        for i in range(first, first + rows):
            self.samples[i] = Sample(i, unit, {})
        return list(range(first, first + rows))

    def produced(self, indexes: list[int], fields: list[str]) -> None:
        """A storage unit stored ``fields`` of these samples."""
        add = frozenset(fields)
        unions: dict[frozenset[str], frozenset[str]] = {}  # a put's samples share one set
        for i in indexes:
            s = self.samples.get(i)
            if s is not None:
                new = unions.get(s.fields)
                if new is None:
                    new = unions[s.fields] = s.fields | add
                s.fields = new

    def share(self, lease: Lease, fields: list[str]) -> dict[str, Any]:
        """A get's answer: the leased samples, where they are, their meta."""
        samples = [self.samples[i] for i in lease.indexes]
        keys = sorted({k for s in samples for k in s.meta})
        self.gets += 1
        return {
            "indexes": lease.indexes,
            "units": [s.unit for s in samples],
            "meta": {k: [s.meta.get(k) for s in samples] for k in keys},
            "partition_meta": self.meta,
            "kinds": {f: k for f in fields if (k := self.signatures[f][0]) != "tensor"},
            "lease": lease.id,
        }

    def consume(
        self, task: str, indexes: list[int], tasks: int
    ) -> tuple[int, dict[int, list[int]]]:
        """``task`` consumed these samples: how many were newly consumed, and the samples
        every one of the ``tasks`` consumed (gone from here), per storage unit."""
        done = 0
        freed: dict[int, list[int]] = {}
        for i in indexes:
            s = self.samples.get(i)
            if s is None or task in s.consumed:
                continue
            s.consumed.add(task)
            s.leased.pop(task, None)
            done += 1
            if len(s.consumed) == tasks:
                del self.samples[i]
                freed.setdefault(s.unit, []).append(i)
        return done, freed

    def forget(self, indexes: list[int]) -> dict[int, list[int]]:
        """Forget these samples; those that were here, per storage unit."""
        by_unit: dict[int, list[int]] = {}
        for i in indexes:
            s = self.samples.pop(i, None)
            if s is not None:
                by_unit.setdefault(s.unit, []).append(i)
        return by_unit

    def by_unit(self) -> dict[int, list[int]]:
        """Every sample, per storage unit."""
        out: dict[int, list[int]] = {}
        for s in self.samples.values():
            out.setdefault(s.unit, []).append(s.index)
        return out

    def check_signatures(self, signatures: dict[str, list[Any]]) -> None:
        """Each field keeps the kind, dtype and row shape of its first put."""
        for name, sig in signatures.items():
            known = self.signatures.get(name)
            if known is not None and known != sig:
                raise SchemaError(
                    f"field `{name}`: expected {describe(known)} as in earlier puts of "
                    f"`{self.name}`, got {describe(sig)} (one field keeps one kind, dtype and "
                    "row shape; send rows of different lengths as a list of tensors)"
                )

    def keep_signatures(self, signatures: dict[str, list[Any]]) -> None:
        for name, sig in signatures.items():
            self.signatures.setdefault(name, sig)

    def set_meta(
        self,
        indexes: list[int],
        meta: dict[str, list[Any]],
        partition_meta: dict[str, Any] | None,
    ) -> None:
        for key, values in meta.items():
            for i, v in zip(indexes, values, strict=True):
                self.samples[i].meta[key] = v
        if partition_meta:
            self.meta.update(partition_meta)

    def holds(self, fields: list[str]) -> str:
        """What a waiting get should know: the fields this partition holds, and the asked
        ones no put has brought."""
        held = sorted(self.signatures)
        missing = [f for f in fields if f not in self.signatures]
        if missing:
            return (
                f"partition `{self.name}` holds fields {held}; no put brought {missing}: "
                "is a field name misspelled?"
            )
        return (
            f"partition `{self.name}` holds fields {held}; producers must put more, or wait longer"
        )

    def statistics(self, tasks: tuple[str, ...]) -> PartitionStatistics:
        per_task = {}
        for t in tasks:
            leased = sum(1 for s in self.samples.values() if t in s.leased)
            consumed = sum(1 for s in self.samples.values() if t in s.consumed)
            depth = len(self.samples) - leased - consumed
            per_task[t] = TaskStatistics(depth=depth, leased=leased)
        return PartitionStatistics(samples=len(self.samples), tasks=per_task)

    def dump(self) -> dict[str, Any]:
        """The partition to save (leases are not kept)."""
        return {
            "name": self.name,
            "meta": self.meta,
            "signatures": self.signatures,
            "samples": [
                [s.index, s.unit, sorted(s.fields), s.meta, sorted(s.consumed)]
                for s in self.samples.values()
            ],
        }

    @classmethod
    def load(cls, saved: dict[str, Any]) -> Partition:
        """The partition :meth:`dump` saved."""
        p = cls(saved["name"], meta=saved["meta"], signatures=saved["signatures"])
        for index, unit, fields, meta, consumed in saved["samples"]:
            s = Sample(index, unit, meta)
            s.fields = frozenset(fields)
            s.consumed.update(consumed)
            p.samples[index] = s
        return p


class Leases:
    """The leases not yet acked nor expired, by id. A lease that nobody acks within
    ``timeout`` seconds calls ``expire(lease id)``."""

    def __init__(self, timeout: float, expire: Callable[[int], None]) -> None:
        self.timeout = timeout
        self._expire = expire
        self._ids = itertools.count(1)
        self.by_id: dict[int, Lease] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def grant(self, p: Partition, task: str, key: tuple[int, int, int], share: list[int]) -> None:
        """Lease ``share`` of ``p`` to ``task`` for the share ``key`` names."""
        lease = Lease(next(self._ids), p.name, task, key, share)
        for i in share:
            p.samples[i].leased[task] = lease.id
        lease.timer = asyncio.get_running_loop().call_later(self.timeout, self._expire, lease.id)
        self.by_id[lease.id] = lease
        p.shares[(task, *key)] = lease

    def end(self, lease: Lease, p: Partition | None) -> None:
        """Forget ``lease`` (``p``: its partition, if it still exists)."""
        self.by_id.pop(lease.id, None)
        if lease.timer is not None:
            lease.timer.cancel()
        if p is not None and p.shares.get((lease.task, *lease.key)) is lease:
            del p.shares[(lease.task, *lease.key)]

    def end_all(self) -> None:
        for lease in self.by_id.values():
            if lease.timer is not None:
                lease.timer.cancel()
        self.by_id.clear()


def ready_samples(p: Partition, task: str, need: frozenset[str]) -> list[int]:
    """Samples of ``p`` that ``task`` has not consumed nor leased and that hold ``need``."""
    holds: dict[frozenset[str], bool] = {}  # a put's samples share one set: test it once
    out = []
    for s in p.samples.values():
        if task in s.consumed or task in s.leased:
            continue
        ok = holds.get(s.fields)
        if ok is None:
            ok = holds[s.fields] = need <= s.fields
        if ok:
            out.append(s.index)
    return out


def describe(sig: list[Any]) -> str:
    if sig[0] in ("tensor", "ndarray"):
        return f"{sig[0]} of {sig[1]} rows of shape {sig[2]}"
    if sig[0] == "nested":
        return f"jagged nested tensor of {sig[1]}"
    return "a list"
