"""The controller: metadata only, never payload.

It knows every partition, every sample's global index, which fields of it are
produced, which storage unit holds it, its custom meta, and per task whether
it is leased or consumed. Requests that cannot be served yet (a ``get`` short
of ready samples, a ``put`` over capacity) are parked on futures and answered
when the state changes or their timeout expires: nothing polls. A client that
disconnects takes its parked requests with it (``disconnected``): a dead
consumer is never leased samples.

Every request is checked whole by its typed decoder (``_messages``) before it
changes anything. Where the storage units are and how full: ``_units.py``; the
samples, partitions and leases: ``_state.py``.

The class holds no process-global state, so it can run in a thread, a child
process, or a Ray actor alike.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import msgspec

from rlferry.wire.lowlevel import AsyncResource

from .._config import QueueConfig
from .._errors import (
    GetTimeout,
    PutTimeout,
    QueueClosed,
    SchemaError,
    ServiceGone,
    UnknownPartition,
    UnknownTask,
)
from .._messages import (
    Ack,
    Alloc,
    Clear,
    Dump,
    Fields,
    Get,
    Info,
    Produced,
    Release,
    Stats,
    controller_request,
)
from ..statistics import ControllerStatistics
from ._parking import Parking
from ._state import Lease, Leases, Partition, ready_samples
from ._units import Units

__all__ = ["Controller"]


class Controller(AsyncResource):
    """The queue's controller; ``handle`` is its wire handler.

    Lifecycle: the constructor takes the config and the units' addresses;
    ``await start()`` connects to the units (it does not wait for them);
    ``await aclose()`` (idempotent) closes those connections and ends the leases'
    timers. A request after that raises :class:`QueueClosed`.
    """

    def __init__(self, config: QueueConfig, units: list[str]) -> None:
        self.config = config
        self.tasks = config.tasks
        self.units = Units(units, config.secret)
        self.capacity = config.capacity
        self.max_partitions = config.max_partitions
        self.lease_timeout = config.lease_timeout
        self.partitions: dict[str, Partition] = {}
        self.held = 0  # samples held (not yet freed)
        self.next_index = 0
        self.leases = Leases(config.lease_timeout, self._expire)
        self.parking = Parking()
        self.waiting_gets = 0
        self.waiting_puts = 0
        self.started = time.monotonic()
        self._closed = False

    async def handle(self, value: Any, peer: bytes) -> Any:
        """The wire handler: a typed request, checked whole, then served."""
        if self._closed:
            raise QueueClosed("the queue's controller is closed")
        msg = controller_request(value)
        if isinstance(msg, Get):
            return await self.parking.serve(peer, self.get(msg))
        if isinstance(msg, Alloc):
            return await self.parking.serve(peer, self.alloc(msg))
        if isinstance(msg, Produced):
            return self.produced(msg.partition, msg.indexes, msg.fields)
        if isinstance(msg, Ack):
            return self.ack(msg)
        if isinstance(msg, Release):
            return self.release(msg.partition, msg.indexes)
        if isinstance(msg, Clear):
            return self.clear(msg.partition)
        if isinstance(msg, Fields):
            return self.fields(msg.partition)
        if isinstance(msg, Info):
            return self.info()
        if isinstance(msg, Stats):
            return msgspec.to_builtins(self.statistics())
        assert isinstance(msg, Dump)
        return self.dump()

    def disconnected(self, peer: bytes) -> None:
        """A client disconnected (closed, died): its parked requests go, unanswered."""
        self.parking.disconnected(peer)

    # -- helpers ----------------------------------------------------------------
    def _task(self, task: str) -> None:
        if task not in self.tasks:
            raise UnknownTask(
                f"task `{task}`: expected one of {list(self.tasks)} "
                "(register every task when the queue starts: Queue(tasks=...) or "
                "`rlferry serve queue --tasks`)"
            )

    def _partition(self, name: str) -> Partition:
        p = self.partitions.get(name)
        if p is None:
            raise UnknownPartition(
                f"partition `{name}`: no such partition (it was never put, or was cleared "
                "or fully consumed)"
            )
        return p

    async def start(self) -> None:
        """Watch every storage unit from now on: new puts go to the units alive."""
        self.units.watch()

    # -- requests ---------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {"tasks": list(self.tasks), "units": list(self.units.addresses)}

    def register_unit(self, address: str) -> int:
        """A storage unit of this process, bound at ``address``; its number."""
        return self.units.register(address)

    async def alloc(self, msg: Alloc) -> dict[str, Any]:
        """Reserve samples (new ones, or the given existing ones) and say where they go.
        Everything is checked before anything is reserved."""
        partition, rows, signatures, meta = msg.partition, msg.rows, msg.signatures, msg.meta
        partition_meta, indexes, timeout = msg.partition_meta, msg.indexes, msg.timeout
        if not self.units:
            raise SchemaError("storage: the queue has no storage unit yet (start one)")
        if indexes is not None:
            p = self._partition(partition)
            missing = [i for i in indexes if i not in p.samples]
            if missing:
                raise SchemaError(
                    f"indexes: {missing[:5]} are not samples of partition `{partition}` "
                    "(add fields only to indexes a put of this partition returned)"
                )
            p.check_signatures(signatures)
            p.keep_signatures(signatures)
            p.set_meta(indexes, meta, partition_meta)
            return {"indexes": indexes, "units": [p.samples[i].unit for i in indexes]}
        if self.capacity is not None and rows > self.capacity:
            raise SchemaError(
                f"put: expected at most capacity={self.capacity} samples, got {rows} "
                "(split the put, or start the queue with a larger capacity)"
            )

        known = self.partitions.get(partition)
        if known is not None:
            known.check_signatures(signatures)

        def room() -> bool | None:
            if self.capacity is not None and self.held + rows > self.capacity:
                return None
            new = partition not in self.partitions
            limit = self.max_partitions
            return None if new and limit is not None and len(self.partitions) >= limit else True

        self.waiting_puts += 1
        try:
            await self.parking.until(room, timeout)
        except TimeoutError:
            raise PutTimeout(
                f"put `{partition}`: no room within {timeout} s (held {self.held} samples of "
                f"capacity {self.capacity}, {len(self.partitions)} partitions of "
                f"max_partitions {self.max_partitions}; consumers must ack or clear)"
            ) from None
        finally:
            self.waiting_puts -= 1
        # A put goes whole to the unit holding the fewest samples: a get of its rows (or of
        # a DP rank's contiguous share) is then one view of one stored column, no copy.
        alive = self.units.alive()
        if not alive:
            raise ServiceGone(
                f"storage: all {len(self.units)} storage units are gone (restart the queue)"
            )
        part = self.partitions.get(partition)
        if part is None:
            part = Partition(partition)
        part.check_signatures(signatures)  # again: another put may have come meanwhile
        self.partitions[partition] = p = part
        p.keep_signatures(signatures)
        first = self.next_index
        self.next_index += rows
        unit = min(alive, key=self.units.load.__getitem__)
        self.units.load[unit] += rows
        new_indexes = p.add(first, rows, unit)
        p.set_meta(new_indexes, meta, partition_meta)
        self.held += rows
        return {"indexes": new_indexes, "units": [unit] * rows}

    async def published(self, partition: str, indexes: list[int], fields: list[str]) -> None:
        """A storage unit of this process stored these rows (``StorageUnit.on_stored``)."""
        self.produced(partition, indexes, fields)

    def produced(self, partition: str, indexes: list[int], fields: list[str]) -> None:
        p = self.partitions.get(partition)
        if p is None:
            return  # cleared meanwhile; the storage units were told to drop it
        p.produced(indexes, fields)
        self.parking.changed()

    async def get(self, msg: Get) -> dict[str, Any]:
        partition, task, fields, batch_size = msg.partition, msg.task, msg.fields, msg.batch_size
        dp_rank, dp_size, batch, timeout = msg.dp_rank, msg.dp_size, msg.batch, msg.timeout
        self._task(task)
        chosen = msg.sampler
        key = (task, dp_size, dp_rank, batch)
        need = frozenset(fields)

        def serve() -> Lease | None:
            p = self.partitions.get(partition)
            if p is None:
                return None
            lease = p.shares.get(key)
            if lease is not None:
                return lease
            ready = ready_samples(p, task, need)
            has_round = any(k[:2] == key[:2] and k[3] == batch for k in p.shares)
            size = 1 if has_round else dp_size  # a re-asked share after a lease expired
            shares = chosen.round(ready, lambda i, k: p.samples[i].meta.get(k), batch_size, size)
            if shares is None:
                return None
            ranks = [dp_rank] if has_round else list(range(dp_size))
            for r, share in zip(ranks, shares, strict=True):
                self.leases.grant(p, task, (dp_size, r, batch), share)
            return p.shares[key]

        self.waiting_gets += 1
        try:
            lease = await self.parking.until(serve, timeout)
        except TimeoutError:
            p = self.partitions.get(partition)
            have = 0 if p is None else len(ready_samples(p, task, need))
            raise GetTimeout(
                f"get `{partition}` for task `{task}`: {have} ready samples with fields "
                f"{fields} within {timeout} s, a batch needs {batch_size} per rank x "
                f"{dp_size} ranks ({self._holds(partition, fields)})"
            ) from None
        finally:
            self.waiting_gets -= 1
        return self.partitions[partition].share(lease, fields)

    def _holds(self, partition: str, fields: list[str]) -> str:
        p = self.partitions.get(partition)
        if p is None:
            return f"partition `{partition}` does not exist: no put made it, or it was freed"
        return p.holds(fields)

    def fields(self, partition: str) -> dict[str, Any]:
        p = self.partitions.get(partition)
        return {"exists": p is not None, "fields": sorted(p.signatures) if p else []}

    def _expire(self, lease_id: int) -> None:
        """The consumer did not ack in time: its samples are ready again for that task."""
        lease = self.leases.by_id.get(lease_id)
        if lease is None:
            return
        p = self.partitions.get(lease.partition)
        self.leases.end(lease, p)
        if p is not None:
            for i in lease.indexes:
                s = p.samples.get(i)
                if s is not None and s.leased.get(lease.task) == lease_id:
                    del s.leased[lease.task]
        self.parking.changed()

    def ack(self, msg: Ack) -> int:
        """Consume leased samples; returns how many were newly consumed."""
        partition, task, lease, indexes = msg.partition, msg.task, msg.lease, msg.indexes
        self._task(task)
        p = self.partitions.get(partition)
        if p is None:
            return 0
        done, freed = p.consume(task, indexes, len(self.tasks))
        self.held -= sum(map(len, freed.values()))
        held = self.leases.by_id.get(lease)
        if held is not None and all(
            task in p.samples[i].consumed for i in held.indexes if i in p.samples
        ):
            self.leases.end(held, self.partitions.get(held.partition))
        if not p.samples:
            for le in list(p.shares.values()):
                self.leases.end(le, p)
            del self.partitions[partition]
        self.units.drop(freed)
        self.parking.changed()
        return done

    def release(self, partition: str, indexes: list[int]) -> None:
        """A put whose payload did not reach storage: forget its new samples."""
        p = self.partitions.get(partition)
        if p is None:
            return
        by_unit = p.forget(indexes)
        self.held -= sum(map(len, by_unit.values()))
        if not p.samples:
            del self.partitions[partition]
        self.units.drop(by_unit)
        self.parking.changed()

    def clear(self, partition: str) -> int:
        p = self.partitions.pop(partition, None)
        if p is None:
            return 0
        for le in list(p.shares.values()):
            self.leases.end(le, p)
        self.held -= len(p.samples)
        self.units.drop(p.by_unit())
        self.parking.changed()
        return len(p.samples)

    def statistics(self) -> ControllerStatistics:
        """Depth per partition and task, samples held, waiters, leases, units alive."""
        return ControllerStatistics(
            partitions={name: p.statistics(self.tasks) for name, p in self.partitions.items()},
            samples_held=self.held,
            waiting_gets=self.waiting_gets,
            waiting_puts=self.waiting_puts,
            leases=len(self.leases),
            storage_units_alive=list(self.units.up),
        )

    def stats(self) -> dict[str, Any]:
        """Deprecated: :meth:`statistics` (a frozen record)."""
        warnings.warn(
            "Controller.stats() is deprecated: use Controller.statistics() (a frozen record)",
            DeprecationWarning,
            stacklevel=2,
        )
        return dict(msgspec.to_builtins(self.statistics()))

    # -- persistence --------------------------------------------------------------
    def dump(self) -> dict[str, Any]:
        """The state to save: leases are not kept (a restored queue redelivers them)."""
        return {
            "next_index": self.next_index,
            "partitions": [p.dump() for p in self.partitions.values()],
        }

    def load(self, state: dict[str, Any]) -> None:
        """Take the state :meth:`dump` saved."""
        self.next_index = state["next_index"]
        for saved in state["partitions"]:
            p = Partition.load(saved)
            self.partitions[p.name] = p
            self.held += len(p.samples)
            for s in p.samples.values():
                self.units.load[s.unit] += 1

    async def aclose(self) -> None:
        """Close the connections to the units and end the leases' timers; a second call
        does nothing."""
        if self._closed:
            return
        self._closed = True
        self.leases.end_all()
        await self.units.aclose()
