"""The asyncio queue client (:class:`AsyncQueueClient`; its sync twin: ``_sync_client.py``).

A put asks the controller for indexes and placement and, meanwhile, copies its
columns once into shared memory (over ipc://); then it sends each storage unit
its rows (in parallel, directly), and each unit tells the controller the rows
exist before it answers.
A get waits at the controller (parked, no polling) for a leased share, then
reads the rows from the storage units in parallel and assembles the batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlferry.wire.lowlevel import CONNECT_TIMEOUT, SHARED_MEMORY, AsyncResource, brief

from ._checks import check_partition, check_timeout, checked_address, checked_put, positive, staged
from ._columns import assemble, split_rows
from ._errors import QueueError, SchemaError, ServiceGone
from ._links import CONTROL_TIMEOUT, Links
from ._messages import Ack, Clear, Fields, Get, Put, Read, Release, Stats
from ._samplers import GrpoGroups, SeqlenBalanced, Sequential, sampler_from
from .statistics import (
    ControllerStatistics,
    QueueStatistics,
    StorageStatistics,
    StorageUnitStatistics,
)

__all__ = ["WARN_AFTER", "AsyncQueueClient", "Batch"]

log = logging.getLogger("rlferry.queue")

_REPLY_MARGIN = 0.5  # a parked request's reply comes this much after its timeout, at most
WARN_AFTER = 5.0
"""Seconds a get waits before it checks that the partition holds its fields (and warns)."""


@dataclass(frozen=True)
class Batch:
    """One share of samples for one task and DP rank, leased until acked."""

    partition: str
    task: str
    indexes: list[int]
    data: dict[str, Any]
    meta: dict[str, list[Any]] = field(default_factory=dict)
    partition_meta: dict[str, Any] = field(default_factory=dict)
    lease: int = 0

    def __len__(self) -> int:
        return len(self.indexes)


class AsyncQueueClient(AsyncResource):
    """The asyncio client of a queue. Errors: :mod:`rlferry.queue` ``QueueError`` subclasses,
    and :class:`~rlferry.wire.SecurityError` when the queue refuses this client's secret.

    Lifecycle: the constructor checks the address (it connects on the first call);
    ``await aclose()`` (idempotent) closes it, and ``async with`` closes it on exit; a
    call after that raises :class:`~rlferry.queue.QueueClosed`.

    A queue that does not answer is noticed within ``connect_timeout`` seconds
    (``ServiceGone: ... never answered``), whatever a call's own ``timeout``.

    For launchers (``rlferry.ray``): ``dial(address)`` gives the address this process
    should connect to for a service known by ``address`` (a same-host ipc:// path for a
    tcp:// one, say); ``why_gone(address, message)`` gives the text of the
    :class:`ServiceGone` raised when the service known by ``address`` disconnects (the
    launcher names the service and the cause its cluster manager reported).
    """

    def __init__(
        self,
        address: str,
        *,
        secret: str | bytes | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        dial: Callable[[str], str] | None = None,
        why_gone: Callable[[str, str], Awaitable[str]] | None = None,
    ) -> None:
        self.address = checked_address(address)
        self._links = Links(
            address, secret=secret, connect_timeout=connect_timeout, dial=dial, why_gone=why_gone
        )
        self._batches: dict[tuple[str, str, int, int], int] = {}
        self._warned: set[tuple[str, str]] = set()
        self._local = SHARED_MEMORY and self._links.controller.address.startswith("ipc://")

    async def put(
        self,
        partition: str,
        data: dict[str, Any],
        *,
        meta: Mapping[str, Sequence[Any]] | None = None,
        indexes: Sequence[int] | None = None,
        partition_meta: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        """Store samples; returns their global indexes.

        ``data`` maps field names to columns (one row per sample); with
        ``indexes`` the fields are added to those existing samples. ``meta``
        maps keys to one value per sample; ``partition_meta`` is merged into the
        partition's meta. Waits (by event) for room when the queue is full, at
        most ``timeout`` seconds (None: as long as it takes).

        Every value is checked before anything is reserved; a put that fails
        later gives back what it reserved.

        Raises:
            SchemaError: fields of different lengths, a kind or shape that
                differs from earlier puts, a value that cannot travel, bad
                indexes or meta.
            PutTimeout: no room within ``timeout``.
            ServiceGone: the controller or a storage unit is unreachable.
        """
        alloc = checked_put(partition, data, meta, indexes, partition_meta, timeout)
        reply_timeout = None if timeout is None else timeout + _REPLY_MARGIN
        placing = asyncio.ensure_future(self._links.ask(alloc, reply_timeout))
        try:
            if self._local:  # the one copy into shared memory runs while the controller places
                data = await staged(data)
            answer = await placing
        except BaseException:
            await self._abandon(placing, partition, indexes is None)
            raise
        placed: list[int] = answer["indexes"]
        try:
            sends = []
            for unit, start, stop in _blocks(answer["units"]):
                columns = {name: split_rows(col, [start, stop])[0] for name, col in data.items()}
                client = await self._links.unit(unit)
                msg = Put(partition, placed[start:stop], columns)
                sends.append(self._links.call(client, msg, CONTROL_TIMEOUT))
            # each unit makes its rows visible at the controller once stored
            await asyncio.gather(*sends)
        except BaseException:
            if indexes is None:
                await self._give_back(partition, placed)
            raise
        return placed

    async def _abandon(self, placing: asyncio.Future[Any], partition: str, new: bool) -> None:
        """A put failed before its data moved: give back the samples it reserved."""
        if not placing.done():
            placing.cancel()  # not placed yet: the controller forgets the request with it
        try:
            answer = await placing
        except (QueueError, asyncio.CancelledError):
            return  # nothing was reserved
        if new:
            await self._give_back(partition, answer["indexes"])

    async def _give_back(self, partition: str, indexes: list[int]) -> None:
        """New samples that never became visible: their room goes back."""
        try:
            await self._links.ask(Release(partition, indexes), CONTROL_TIMEOUT)
        except QueueError as e:  # the controller is gone: its state went with it
            log.warning("put `%s`: could not give back %d samples: %s", partition, len(indexes), e)

    async def get(
        self,
        partition: str,
        *,
        task: str,
        batch_size: int,
        fields: Sequence[str],
        dp_rank: int = 0,
        dp_size: int = 1,
        sampler: str | Sequential | GrpoGroups | SeqlenBalanced = "sequential",
        timeout: float | None = None,
    ) -> Batch:
        """Wait for ``batch_size`` ready samples of ``partition`` for ``task`` and lease them.

        With ``dp_size=N`` one round of ``N * batch_size`` samples is shared among
        the N ranks; every caller of one (partition, task, dp_rank, batch number)
        gets the same samples (TP/PP peers of a DP rank call get alike). Never
        returns an empty batch. A get that has waited ``WARN_AFTER`` seconds for
        fields that no put of the partition brought logs a warning naming them
        (a misspelled field would otherwise wait silently).

        Raises:
            GetTimeout: too few ready samples within ``timeout``; nothing leased.
                Its message names the fields the partition holds.
            UnknownTask, SchemaError: bad arguments.
            ServiceGone: the controller or a storage unit is unreachable.
        """
        check_partition(partition)
        positive("batch_size", batch_size)
        positive("dp_size", dp_size)
        if type(dp_rank) is not int or not 0 <= dp_rank < dp_size:
            raise SchemaError(f"dp_rank: expected an int in [0, {dp_size}), got {dp_rank!r}")
        if isinstance(fields, str) or not isinstance(fields, Sequence):
            raise SchemaError(
                f"fields: expected a list of field names, got {brief(fields)} "
                "(e.g. fields=['tokens'])"
            )
        fields = list(fields)
        if not fields or not all(isinstance(f, str) and f for f in fields):
            raise SchemaError(f"fields: expected a non-empty list of field names, got {fields!r}")
        check_timeout(timeout)
        key = (partition, task, dp_rank, dp_size)
        number = self._batches.get(key, 0)
        msg = Get(
            partition, task, fields, batch_size, dp_rank, dp_size, number,
            sampler_from(sampler), timeout,
        )  # fmt: skip
        reply_timeout = None if timeout is None else timeout + _REPLY_MARGIN
        asking = asyncio.ensure_future(self._links.ask(msg, reply_timeout))
        try:
            if timeout is None or timeout > WARN_AFTER:
                await asyncio.wait([asking], timeout=WARN_AFTER)  # one bounded wait, then:
                if not asking.done():
                    await self._warn_missing(partition, task, fields)
            share = await asking
        finally:
            asking.cancel()  # this call was cancelled: so is its parked request
        self._batches[key] = number + 1
        indexes: list[int] = share["indexes"]
        by_unit: dict[int, list[int]] = {}
        for pos, unit in enumerate(share["units"]):
            by_unit.setdefault(unit, []).append(pos)
        reads = []
        for unit, positions in by_unit.items():
            client = await self._links.unit(unit)
            read = Read([indexes[p] for p in positions], fields)
            reads.append(self._links.call(client, read, CONTROL_TIMEOUT))
        parts = await asyncio.gather(*reads)
        n = len(indexes)
        kinds = share["kinds"]  # of the fields that are not plain tensors
        if len(parts) == 1:  # one unit, asked in batch order: its answer is the batch
            data = parts[0]
            for name, kind in kinds.items():
                if kind == "nested":  # a jagged field may come as its rows
                    data[name] = assemble("nested", [(indexes, data[name])], n, whole=True)
        else:
            data = {}
            for name in fields:
                pieces = [
                    (pos, part[name]) for pos, part in zip(by_unit.values(), parts, strict=True)
                ]
                data[name] = assemble(kinds.get(name, "tensor"), pieces, n)
        return Batch(
            partition, task, indexes, data, share["meta"], share["partition_meta"], share["lease"]
        )

    async def _warn_missing(self, partition: str, task: str, fields: list[str]) -> None:
        """A get has waited a while: if the partition lacks some of its fields, say so once."""
        try:
            held = await self._links.ask(Fields(partition), CONTROL_TIMEOUT)
        except QueueError:
            return  # the get itself will report what went wrong
        missing = [f for f in fields if f not in held["fields"]]
        missing = [f for f in missing if (partition, f) not in self._warned]
        if held["exists"] and missing:
            self._warned.update((partition, f) for f in missing)
            log.warning(
                "get `%s` for task `%s` has waited %g s for fields %s that no put of the "
                "partition brought yet (it holds %s): is a field name misspelled?",
                partition, task, WARN_AFTER, missing, held["fields"],
            )  # fmt: skip

    async def ack(self, batch: Batch) -> int:
        """Mark the batch consumed for its task; returns how many samples were newly consumed."""
        msg = Ack(batch.partition, batch.task, batch.lease, batch.indexes)
        return int(await self._links.ask(msg, CONTROL_TIMEOUT))

    async def clear(self, partition: str) -> int:
        """Drop a partition and its data now, consumed or not; returns how many samples went."""
        check_partition(partition)
        return int(await self._links.ask(Clear(partition), CONTROL_TIMEOUT))

    async def statistics(self) -> QueueStatistics:
        """Depth per partition and task, leases, waiters, and per storage unit bytes and rates."""
        answer = await self._links.ask(Stats(), CONTROL_TIMEOUT)
        ctrl = msgspec.convert(answer, ControllerStatistics)
        units = []
        for u, alive in enumerate(ctrl.storage_units_alive):
            link = await self._links.unit(u)
            unit = StorageUnitStatistics(alive=alive, address=link.address)
            if alive:
                try:
                    answer = await self._links.call(link, Stats(), CONTROL_TIMEOUT)
                    counters = msgspec.structs.asdict(msgspec.convert(answer, StorageStatistics))
                    unit = msgspec.structs.replace(unit, **counters)
                except ServiceGone as e:  # died before the controller heard of it
                    unit = msgspec.structs.replace(unit, alive=False, error=str(e))
            units.append(unit)
        return QueueStatistics(
            partitions=ctrl.partitions,
            samples_held=ctrl.samples_held,
            waiting_gets=ctrl.waiting_gets,
            waiting_puts=ctrl.waiting_puts,
            leases=ctrl.leases,
            storage_units=units,
            bytes_held=sum(u.bytes_held for u in units),
        )

    async def aclose(self) -> None:
        """Close the links to the queue's services; a second call does nothing."""
        await self._links.aclose()


def _blocks(units: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal unit numbers: ``(unit, start, stop)``."""
    out: list[tuple[int, int, int]] = []
    for i, u in enumerate(units):
        if out and out[-1][0] == u and out[-1][2] == i:
            out[-1] = (u, out[-1][1], i + 1)
        else:
            out.append((u, i, i + 1))
    return out
