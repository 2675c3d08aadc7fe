"""The controller's state: samples, leases, partitions (data, no behaviour of the queue)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Lease", "Partition", "Sample", "describe", "ready_samples"]

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
