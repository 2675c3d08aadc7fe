"""The controller: metadata only, never payload.

It knows every partition, every sample's global index, which fields of it are
produced, which storage unit holds it, its custom meta, and per task whether
it is leased or consumed. Requests that cannot be served yet (a ``get`` short
of ready samples, a ``put`` over capacity) are parked on futures and answered
when the state changes or their timeout expires: nothing polls. A client that
disconnects takes its parked requests with it (``disconnected``): a dead
consumer is never leased samples.

Every request is checked whole by its typed decoder (``_messages``) before it
changes anything.

The class holds no process-global state, so it can run in a thread, a child
process, or a Ray actor alike.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from rlferry.wire import AsyncClient

from ._config import QueueConfig
from ._errors import (
    GetTimeout,
    PutTimeout,
    SchemaError,
    ServiceGone,
    UnknownPartition,
    UnknownTask,
)
from ._messages import (
    Ack,
    Alloc,
    Clear,
    Drop,
    Dump,
    Fields,
    Get,
    Info,
    Produced,
    Release,
    Stats,
    controller_request,
    to_wire,
)
from ._state import Lease, Partition, Sample, describe, ready_samples

__all__ = ["Controller"]

T = TypeVar("T")

log = logging.getLogger("rlferry.queue")


class Controller:
    """The queue's controller; ``handle`` is its wire handler."""

    def __init__(self, config: QueueConfig, units: list[str]) -> None:
        self.config = config
        self.tasks = config.tasks
        self.units = list(units)
        self.capacity = config.capacity
        self.max_partitions = config.max_partitions
        self.lease_timeout = config.lease_timeout
        self.partitions: dict[str, Partition] = {}
        self.held = 0  # samples held (not yet freed)
        self.unit_load = [0] * len(units)  # samples held per storage unit
        self.unit_up = [True] * len(units)  # False once its connection is lost: puts avoid it
        self.next_index = 0
        self.lease_ids = itertools.count(1)
        self.leases: dict[int, Lease] = {}
        self.changed = asyncio.Event()  # set and replaced on every change waiters care about
        self.waiting_gets = 0
        self.waiting_puts = 0
        self.started = time.monotonic()
        self._secret = config.secret
        self._unit_clients: list[AsyncClient] = []
        self._bg: set[asyncio.Task[Any]] = set()
        self._parked: dict[bytes, set[asyncio.Task[Any]]] = {}  # per client: waiting requests

    async def handle(self, value: Any, peer: bytes) -> Any:
        """The wire handler: a typed request, checked whole, then served."""
        msg = controller_request(value)
        if isinstance(msg, Get):
            return await self._parking(peer, self.get(msg))
        if isinstance(msg, Alloc):
            return await self._parking(peer, self.alloc(msg))
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
            return self.stats()
        assert isinstance(msg, Dump)
        return self.dump()

    async def _parking(self, peer: bytes, request: Coroutine[Any, Any, T]) -> T:
        """Serve a request that may wait, as part of ``peer``'s parked requests."""
        task = asyncio.current_task()
        assert task is not None
        parked = self._parked.setdefault(peer, set())
        parked.add(task)
        try:
            return await request
        finally:
            parked.discard(task)
            if not parked:
                self._parked.pop(peer, None)

    def disconnected(self, peer: bytes) -> None:
        """A client disconnected (closed, died): its parked requests go, unanswered."""
        for task in self._parked.pop(peer, ()):
            task.cancel()

    # -- helpers ----------------------------------------------------------------
    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def _until(self, ready: Callable[[], Any], timeout: float | None) -> Any:
        """Wait, on events, until ``ready()`` returns something other than None."""
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while (result := ready()) is None:
            event = self.changed
            remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                raise TimeoutError from None
        return result

    def _task(self, task: str) -> None:
        if task not in self.tasks:
            raise UnknownTask(
                f"task `{task}`: expected one of {list(self.tasks)} "
                "(register every task when the queue starts: Queue.start(tasks=...) or "
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

    def _unit_client(self, unit: int) -> AsyncClient:
        while len(self._unit_clients) <= unit:
            u = len(self._unit_clients)
            state = functools.partial(self._unit_state, u)
            self._unit_clients.append(
                AsyncClient(self.units[u], secret=self._secret, on_state=state)
            )
        return self._unit_clients[unit]

    def _unit_state(self, unit: int, up: bool) -> None:
        if self.unit_up[unit] != up:
            state = "back" if up else "gone"
            log.warning("storage unit %d (%s) is %s", unit, self.units[unit], state)
        self.unit_up[unit] = up

    async def start(self) -> None:
        """Watch every storage unit from now on: new puts go to the units alive."""
        for unit in range(len(self.units)):
            self._unit_client(unit).connect()

    def _drop(self, by_unit: dict[int, list[int]]) -> None:
        for unit, indexes in by_unit.items():
            self.unit_load[unit] -= len(indexes)
            if not self.unit_up[unit]:
                continue  # its memory went with it
            req = self._unit_client(unit).request(to_wire(Drop(indexes)), timeout=30)
            task = asyncio.ensure_future(req)
            self._bg.add(task)
            task.add_done_callback(functools.partial(self._dropped, unit, len(indexes)))

    def _dropped(self, unit: int, count: int, task: asyncio.Task[Any]) -> None:
        self._bg.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "storage unit %d (%s) did not drop %d freed samples: %s (its memory stays "
                "held until it restarts)", unit, self.units[unit], count, task.exception(),
            )  # fmt: skip

    # -- requests ---------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {"tasks": list(self.tasks), "units": self.units}

    def register_unit(self, address: str) -> int:
        self.units.append(address)
        self.unit_load.append(0)
        self.unit_up.append(True)
        return len(self.units) - 1

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
            self._check_signatures(p, signatures)
            self._keep_signatures(p, signatures)
            self._set_meta(p, indexes, meta, partition_meta)
            return {"indexes": indexes, "units": [p.samples[i].unit for i in indexes]}
        if self.capacity is not None and rows > self.capacity:
            raise SchemaError(
                f"put: expected at most capacity={self.capacity} samples, got {rows} "
                "(split the put, or start the queue with a larger capacity)"
            )

        known = self.partitions.get(partition)
        if known is not None:
            self._check_signatures(known, signatures)

        def room() -> bool | None:
            if self.capacity is not None and self.held + rows > self.capacity:
                return None
            new = partition not in self.partitions
            limit = self.max_partitions
            return None if new and limit is not None and len(self.partitions) >= limit else True

        self.waiting_puts += 1
        try:
            await self._until(room, timeout)
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
        alive = [u for u in range(len(self.units)) if self.unit_up[u]]
        if not alive:
            raise ServiceGone(
                f"storage: all {len(self.units)} storage units are gone (restart the queue)"
            )
        part = self.partitions.get(partition)
        if part is None:
            part = Partition(partition)
        self._check_signatures(part, signatures)  # again: another put may have come meanwhile
        self.partitions[partition] = p = part
        self._keep_signatures(p, signatures)
        first = self.next_index
        self.next_index += rows
        unit = min(alive, key=self.unit_load.__getitem__)
        self.unit_load[unit] += rows
        units = [unit] * rows
        for r in range(rows):
            p.samples[first + r] = Sample(first + r, units[r], {})
        new_indexes = list(range(first, first + rows))
        self._set_meta(p, new_indexes, meta, partition_meta)
        self.held += rows
        return {"indexes": new_indexes, "units": units}

    def _check_signatures(self, p: Partition, signatures: dict[str, list[Any]]) -> None:
        for name, sig in signatures.items():
            known = p.signatures.get(name)
            if known is not None and known != sig:
                raise SchemaError(
                    f"field `{name}`: expected {describe(known)} as in earlier puts of "
                    f"`{p.name}`, got {describe(sig)} (one field keeps one kind, dtype and "
                    "row shape; send rows of different lengths as a list of tensors)"
                )

    def _keep_signatures(self, p: Partition, signatures: dict[str, list[Any]]) -> None:
        for name, sig in signatures.items():
            p.signatures.setdefault(name, sig)

    def _set_meta(
        self,
        p: Partition,
        indexes: list[int],
        meta: dict[str, list[Any]],
        partition_meta: dict[str, Any] | None,
    ) -> None:
        for key, values in meta.items():
            for i, v in zip(indexes, values, strict=True):
                p.samples[i].meta[key] = v
        if partition_meta:
            p.meta.update(partition_meta)

    async def published(self, partition: str, indexes: list[int], fields: list[str]) -> None:
        """A storage unit of this process stored these rows (``StorageUnit.on_stored``)."""
        self.produced(partition, indexes, fields)

    def produced(self, partition: str, indexes: list[int], fields: list[str]) -> None:
        p = self.partitions.get(partition)
        if p is None:
            return  # cleared meanwhile; the storage units were told to drop it
        add = frozenset(fields)
        unions: dict[frozenset[str], frozenset[str]] = {}  # a put's samples share one set
        for i in indexes:
            s = p.samples.get(i)
            if s is not None:
                new = unions.get(s.fields)
                if new is None:
                    new = unions[s.fields] = s.fields | add
                s.fields = new
        self._notify()

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
                self._lease(p, task, (dp_size, r, batch), share)
            return p.shares[key]

        self.waiting_gets += 1
        try:
            lease = await self._until(serve, timeout)
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
        p = self.partitions[partition]
        samples = [p.samples[i] for i in lease.indexes]
        keys = sorted({k for s in samples for k in s.meta})
        p.gets += 1
        return {
            "indexes": lease.indexes,
            "units": [s.unit for s in samples],
            "meta": {k: [s.meta.get(k) for s in samples] for k in keys},
            "partition_meta": p.meta,
            "kinds": {f: k for f in fields if (k := p.signatures[f][0]) != "tensor"},
            "lease": lease.id,
        }

    def _holds(self, partition: str, fields: list[str]) -> str:
        """What a waiting get should know: the fields the partition holds, and the asked
        ones no put has brought."""
        p = self.partitions.get(partition)
        if p is None:
            return f"partition `{partition}` does not exist: no put made it, or it was freed"
        held = sorted(p.signatures)
        missing = [f for f in fields if f not in p.signatures]
        if missing:
            return (
                f"partition `{partition}` holds fields {held}; no put brought {missing}: "
                "is a field name misspelled?"
            )
        return (
            f"partition `{partition}` holds fields {held}; producers must put more, or wait longer"
        )

    def fields(self, partition: str) -> dict[str, Any]:
        p = self.partitions.get(partition)
        return {"exists": p is not None, "fields": sorted(p.signatures) if p else []}

    def _lease(self, p: Partition, task: str, key: tuple[int, int, int], share: list[int]) -> None:
        lease = Lease(next(self.lease_ids), p.name, task, key, share)
        for i in share:
            p.samples[i].leased[task] = lease.id
        lease.timer = asyncio.get_running_loop().call_later(
            self.lease_timeout, self._expire, lease.id
        )
        self.leases[lease.id] = lease
        p.shares[(task, *key)] = lease

    def _end_lease(self, lease: Lease) -> Partition | None:
        self.leases.pop(lease.id, None)
        if lease.timer is not None:
            lease.timer.cancel()
        p = self.partitions.get(lease.partition)
        if p is not None and p.shares.get((lease.task, *lease.key)) is lease:
            del p.shares[(lease.task, *lease.key)]
        return p

    def _expire(self, lease_id: int) -> None:
        """The consumer did not ack in time: its samples are ready again for that task."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        p = self._end_lease(lease)
        if p is not None:
            for i in lease.indexes:
                s = p.samples.get(i)
                if s is not None and s.leased.get(lease.task) == lease_id:
                    del s.leased[lease.task]
        self._notify()

    def ack(self, msg: Ack) -> int:
        """Consume leased samples; returns how many were newly consumed."""
        partition, task, lease, indexes = msg.partition, msg.task, msg.lease, msg.indexes
        self._task(task)
        p = self.partitions.get(partition)
        if p is None:
            return 0
        done = 0
        freed: dict[int, list[int]] = {}
        for i in indexes:
            s = p.samples.get(i)
            if s is None or task in s.consumed:
                continue
            s.consumed.add(task)
            s.leased.pop(task, None)
            done += 1
            if len(s.consumed) == len(self.tasks):
                del p.samples[i]
                self.held -= 1
                freed.setdefault(s.unit, []).append(i)
        held = self.leases.get(lease)
        if held is not None and all(
            task in p.samples[i].consumed for i in held.indexes if i in p.samples
        ):
            self._end_lease(held)
        if not p.samples:
            for le in list(p.shares.values()):
                self._end_lease(le)
            del self.partitions[partition]
        self._drop(freed)
        self._notify()
        return done

    def release(self, partition: str, indexes: list[int]) -> None:
        """A put whose payload did not reach storage: forget its new samples."""
        p = self.partitions.get(partition)
        if p is None:
            return
        by_unit: dict[int, list[int]] = {}
        for i in indexes:
            s = p.samples.pop(i, None)
            if s is not None:
                self.held -= 1
                by_unit.setdefault(s.unit, []).append(i)
        if not p.samples:
            del self.partitions[partition]
        self._drop(by_unit)
        self._notify()

    def clear(self, partition: str) -> int:
        p = self.partitions.pop(partition, None)
        if p is None:
            return 0
        for le in list(p.shares.values()):
            self._end_lease(le)
        by_unit: dict[int, list[int]] = {}
        for s in p.samples.values():
            by_unit.setdefault(s.unit, []).append(s.index)
        self.held -= len(p.samples)
        self._drop(by_unit)
        self._notify()
        return len(p.samples)

    def stats(self) -> dict[str, Any]:
        parts = {}
        for name, p in self.partitions.items():
            per_task = {}
            for t in self.tasks:
                leased = sum(1 for s in p.samples.values() if t in s.leased)
                consumed = sum(1 for s in p.samples.values() if t in s.consumed)
                per_task[t] = {"depth": len(p.samples) - leased - consumed, "leased": leased}
            parts[name] = {"samples": len(p.samples), "tasks": per_task}
        return {
            "partitions": parts,
            "samples_held": self.held,
            "waiting_gets": self.waiting_gets,
            "waiting_puts": self.waiting_puts,
            "leases": len(self.leases),
            "storage_units_alive": list(self.unit_up),
        }

    # -- persistence --------------------------------------------------------------
    def dump(self) -> dict[str, Any]:
        """The state to save: leases are not kept (a restored queue redelivers them)."""
        return {
            "next_index": self.next_index,
            "partitions": [
                {
                    "name": p.name,
                    "meta": p.meta,
                    "signatures": p.signatures,
                    "samples": [
                        [s.index, s.unit, sorted(s.fields), s.meta, sorted(s.consumed)]
                        for s in p.samples.values()
                    ],
                }
                for p in self.partitions.values()
            ],
        }

    def load(self, state: dict[str, Any]) -> None:
        self.next_index = state["next_index"]
        for pd in state["partitions"]:
            p = Partition(pd["name"], meta=pd["meta"], signatures=pd["signatures"])
            for index, unit, fields, meta, consumed in pd["samples"]:
                s = Sample(index, unit, meta)
                s.fields = frozenset(fields)
                s.consumed.update(consumed)
                p.samples[index] = s
            self.partitions[p.name] = p
            self.held += len(p.samples)
            for s in p.samples.values():
                self.unit_load[s.unit] += 1

    async def close(self) -> None:
        for c in self._unit_clients:
            await c.close()
