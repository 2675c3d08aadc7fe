"""Queue clients: asyncio (:class:`AsyncQueueClient`) and sync (:class:`QueueClient`).

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
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlferry.wire import (
    AsyncClient,
    ChannelClosed,
    PeerGone,
    RemoteError,
    RequestTimeout,
    SecurityError,
    WireError,
    wire_loop,
)
from rlferry.wire._clients import CONNECT_TIMEOUT
from rlferry.wire._errors import brief
from rlferry.wire._shm import AVAILABLE as SHARED_MEMORY

from ._checks import check_partition, check_timeout, checked_address, checked_put, positive, staged
from ._columns import assemble, split_rows
from ._errors import ERRORS, QueueClosed, QueueError, SchemaError, ServiceGone
from ._messages import Ack, Clear, Fields, Get, Info, Put, Read, Release, Stats, to_wire
from ._samplers import GrpoGroups, SeqlenBalanced, Sequential, sampler_from

__all__ = ["WARN_AFTER", "AsyncQueueClient", "Batch", "QueueClient"]

log = logging.getLogger("rlferry.queue")

T = TypeVar("T")
_CONTROL_TIMEOUT = 30.0  # requests that never wait on other clients (a dead peer: at once)
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


class AsyncQueueClient:
    """The asyncio client of a queue. Errors: :mod:`rlferry.queue` ``QueueError`` subclasses,
    and :class:`~rlferry.wire.SecurityError` when the queue refuses this client's secret.

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
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._dial = dial
        self._why_gone = why_gone
        self._known: dict[str, str] = {}  # dialed address -> the address the service is known by
        self._controller = self._client_of(address)
        self._units: list[AsyncClient] = []
        self._batches: dict[tuple[str, str, int, int], int] = {}
        self._warned: set[tuple[str, str]] = set()
        self._local = SHARED_MEMORY and self._controller.address.startswith("ipc://")

    def _client_of(self, address: str) -> AsyncClient:
        dialed = self._dial(address) if self._dial is not None else address
        self._known[dialed] = address
        return AsyncClient(dialed, secret=self._secret, connect_timeout=self._connect_timeout)

    async def _call(self, client: AsyncClient, msg: Any, timeout: float | None) -> Any:
        try:
            return await client.request(to_wire(msg), timeout)
        except RemoteError as e:
            known = ERRORS.get(e.kind)
            if known is None:
                raise RemoteError(e.kind, f"{e.message} (at {client.address})") from None
            raise known(e.message) from None
        except SecurityError:
            raise
        except PeerGone as e:
            message = str(e)
            if self._why_gone is not None:
                message = await self._why_gone(self._known[client.address], message)
            raise ServiceGone(message) from None
        except RequestTimeout:
            raise ServiceGone(
                f"{client.address} did not answer within {timeout} s (is it running?)"
            ) from None
        except ChannelClosed:
            raise QueueClosed("this queue client is closed") from None
        except WireError as e:  # put checked its values before: this is a bug, say so whole
            raise SchemaError(f"request `{msg.__struct_config__.tag}`: {e}") from None

    async def _unit(self, unit: int) -> AsyncClient:
        if unit >= len(self._units):
            info = await self._call(self._controller, Info(), _CONTROL_TIMEOUT)
            for address in info["units"][len(self._units) :]:
                self._units.append(self._client_of(address))
        return self._units[unit]

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
        placing = asyncio.ensure_future(self._call(self._controller, alloc, reply_timeout))
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
                client = await self._unit(unit)
                msg = Put(partition, placed[start:stop], columns)
                sends.append(self._call(client, msg, _CONTROL_TIMEOUT))
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
            await self._call(self._controller, Release(partition, indexes), _CONTROL_TIMEOUT)
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
        asking = asyncio.ensure_future(self._call(self._controller, msg, reply_timeout))
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
            client = await self._unit(unit)
            read = Read([indexes[p] for p in positions], fields)
            reads.append(self._call(client, read, _CONTROL_TIMEOUT))
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
            held = await self._call(self._controller, Fields(partition), _CONTROL_TIMEOUT)
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
        return int(await self._call(self._controller, msg, _CONTROL_TIMEOUT))

    async def clear(self, partition: str) -> int:
        """Drop a partition and its data now, consumed or not; returns how many samples went."""
        check_partition(partition)
        return int(await self._call(self._controller, Clear(partition), _CONTROL_TIMEOUT))

    async def statistics(self) -> dict[str, Any]:
        """Depth per partition and task, leases, waiters, and per storage unit bytes and rates."""
        stats = await self._call(self._controller, Stats(), _CONTROL_TIMEOUT)
        units = []
        for u, alive in enumerate(stats.pop("storage_units_alive")):
            unit = await self._unit(u)
            one = {"alive": alive, "address": unit.address}
            if alive:
                try:
                    one.update(await self._call(unit, Stats(), _CONTROL_TIMEOUT))
                except ServiceGone as e:  # died before the controller heard of it
                    one.update(alive=False, error=str(e))
            units.append(one)
        stats["storage_units"] = units
        stats["bytes_held"] = sum(u.get("bytes_held", 0) for u in units)
        return dict(stats)

    async def close(self) -> None:
        for c in [self._controller, *self._units]:
            await c.close()


def _blocks(units: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal unit numbers: ``(unit, start, stop)``."""
    out: list[tuple[int, int, int]] = []
    for i, u in enumerate(units):
        if out and out[-1][0] == u and out[-1][2] == i:
            out[-1] = (u, out[-1][1], i + 1)
        else:
            out.append((u, i, i + 1))
    return out


class QueueClient:
    """The sync client: the same methods as :class:`AsyncQueueClient`, blocking.

    Safe to share between threads; runs on the process's wire loop.
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
        self._loop = wire_loop()
        self._client = AsyncQueueClient(
            address, secret=secret, connect_timeout=connect_timeout, dial=dial, why_gone=why_gone
        )
        self.address = address

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    def put(
        self,
        partition: str,
        data: dict[str, Any],
        *,
        meta: Mapping[str, Sequence[Any]] | None = None,
        indexes: Sequence[int] | None = None,
        partition_meta: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        return self._run(
            self._client.put(
                partition, data, meta=meta, indexes=indexes, partition_meta=partition_meta,
                timeout=timeout,
            )
        )  # fmt: skip

    def get(
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
        return self._run(
            self._client.get(
                partition, task=task, batch_size=batch_size, fields=fields, dp_rank=dp_rank,
                dp_size=dp_size, sampler=sampler, timeout=timeout,
            )
        )  # fmt: skip

    def ack(self, batch: Batch) -> int:
        return self._run(self._client.ack(batch))

    def clear(self, partition: str) -> int:
        return self._run(self._client.clear(partition))

    def statistics(self) -> dict[str, Any]:
        return self._run(self._client.statistics())

    def close(self) -> None:
        self._run(self._client.close())

    def __enter__(self) -> QueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


for _name in ("put", "get", "ack", "clear", "statistics"):
    getattr(QueueClient, _name).__doc__ = getattr(AsyncQueueClient, _name).__doc__
