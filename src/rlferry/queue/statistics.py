"""The queue's statistics: frozen records, from the services and for the user.

A client's ``statistics()`` (``Queue.statistics()``, ``QueueClient.statistics()``)
answers one :class:`QueueStatistics`: per partition a :class:`PartitionStatistics`
(per task a :class:`TaskStatistics`), per storage unit a :class:`StorageUnitStatistics`.
It puts them together from the services' own records: the controller's
:class:`ControllerStatistics` and each storage unit's :class:`StorageStatistics`.
They travel as plain dicts (``msgspec.to_builtins``) and come back checked
(``msgspec.convert``).

Reading a record like a dict (``stats["samples_held"]``) still works for one
release, with a ``DeprecationWarning``: read the attribute.
"""

from __future__ import annotations

import warnings
from typing import Any

import msgspec

__all__ = [
    "ControllerStatistics",
    "PartitionStatistics",
    "QueueStatistics",
    "StorageStatistics",
    "StorageUnitStatistics",
    "TaskStatistics",
]


class _Record(msgspec.Struct, frozen=True, kw_only=True):
    def __getitem__(self, key: str) -> Any:
        """Deprecated: read the attribute (``stats.samples_held``)."""
        name = type(self).__name__
        warnings.warn(
            f"{name}[{key!r}] is deprecated: {name} is a frozen record, read its attribute "
            f"`.{key}`",
            DeprecationWarning,
            stacklevel=2,
        )
        if key not in self.__struct_fields__:
            raise KeyError(key)
        return getattr(self, key)


class TaskStatistics(_Record, frozen=True, kw_only=True):
    """One task's view of one partition."""

    depth: int
    """Samples the task can still get: neither leased to it nor consumed by it."""
    leased: int
    """Samples leased to the task and not acked yet."""


class PartitionStatistics(_Record, frozen=True, kw_only=True):
    """One partition: its samples, and per task how many are left and leased."""

    samples: int
    """Samples held (not yet consumed by every task)."""
    tasks: dict[str, TaskStatistics]
    """Per registered task."""


class ControllerStatistics(_Record, frozen=True, kw_only=True):
    """What the controller knows (``Controller.statistics()``): metadata, no payload."""

    partitions: dict[str, PartitionStatistics]
    """Per partition held."""
    samples_held: int
    """Samples of every partition, not yet consumed by every task."""
    waiting_gets: int
    """Gets parked until enough samples are ready."""
    waiting_puts: int
    """Puts parked until there is room (capacity, max_partitions)."""
    leases: int
    """Leases not yet acked nor expired."""
    storage_units_alive: list[bool]
    """Per storage unit, whether the controller's connection to it is up."""


class StorageStatistics(_Record, frozen=True, kw_only=True):
    """One storage unit's counters (``StorageUnit.statistics()``)."""

    bytes_held: int
    """Payload bytes held."""
    bytes_in: int
    """Payload bytes stored since the unit started."""
    bytes_out: int
    """Payload bytes read since the unit started."""
    put_bytes_per_s: float
    """``bytes_in`` over the seconds since the unit started."""
    get_bytes_per_s: float
    """``bytes_out`` over the seconds since the unit started."""
    samples: int
    """Samples with at least one field held."""


class StorageUnitStatistics(_Record, frozen=True, kw_only=True):
    """One storage unit as a client sees it: where, whether alive, and its counters
    (zero when it is gone)."""

    alive: bool
    """Whether it answered (and the controller's connection to it is up)."""
    address: str
    """The address this client reaches it at."""
    bytes_held: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    put_bytes_per_s: float = 0.0
    get_bytes_per_s: float = 0.0
    samples: int = 0
    error: str | None = None
    """Why it did not answer, when the controller thought it alive."""


class QueueStatistics(_Record, frozen=True, kw_only=True):
    """A queue's state: depth per partition and task, leases, waiters, and per storage
    unit bytes and rates."""

    partitions: dict[str, PartitionStatistics]
    """Per partition held."""
    samples_held: int
    """Samples of every partition, not yet consumed by every task."""
    waiting_gets: int
    """Gets parked until enough samples are ready."""
    waiting_puts: int
    """Puts parked until there is room (capacity, max_partitions)."""
    leases: int
    """Leases not yet acked nor expired."""
    storage_units: list[StorageUnitStatistics]
    """Per storage unit, in the controller's order."""
    bytes_held: int
    """Payload bytes held by every storage unit alive."""
