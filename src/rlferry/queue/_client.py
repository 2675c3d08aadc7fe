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
import re
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import torch

from rlferry.wire import (
    AsyncClient,
    ChannelClosed,
    PeerGone,
    RemoteError,
    RequestTimeout,
    WireError,
    encode,
    wire_loop,
)
from rlferry.wire._shm import AVAILABLE as SHARED_MEMORY

from ._columns import (
    assemble,
    kind_of,
    nbytes,
    packed_string_columns,
    rows_of,
    shared_columns,
    shared_tensor_columns,
    signature,
    split_rows,
)
from ._errors import ERRORS, QueueClosed, QueueError, SchemaError, ServiceGone
from ._samplers import GrpoGroups, SeqlenBalanced, Sequential, sampler_from

__all__ = ["AsyncQueueClient", "Batch", "QueueClient"]

T = TypeVar("T")
_CONTROL_TIMEOUT = 30.0
_STAGE_IN_THREAD = 4 << 20  # a put of this many bytes or more copies off the event loop
_PLAIN = frozenset(
    (str, bytes, int, float, bool, type(None), torch.Tensor)
)  # for requests that never wait on other clients


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


def _check_partition(partition: Any) -> None:
    if not isinstance(partition, str):
        raise SchemaError(
            f"partition: expected str, got {type(partition).__name__} {partition!r} "
            "(name partitions like 'train_17')"
        )


def _positive(name: str, value: Any) -> None:
    if type(value) is not int or value < 1:
        raise SchemaError(f"{name}: expected a positive int, got {value!r}")


class AsyncQueueClient:
    """The asyncio client of a queue. Errors: :mod:`rlferry.queue` ``QueueError`` subclasses."""

    def __init__(self, address: str, *, secret: str | bytes | None = None) -> None:
        self.address = address
        self._secret = secret
        self._controller = AsyncClient(address, secret=secret)
        self._units: list[AsyncClient] = []
        self._batches: dict[tuple[str, str, int, int], int] = {}
        self._local = SHARED_MEMORY and address.startswith("ipc://")

    async def _call(
        self, client: AsyncClient, op: str, args: dict[str, Any], timeout: float | None
    ) -> Any:
        try:
            return await client.request([op, args], timeout)
        except RemoteError as e:
            raise ERRORS.get(e.kind, ServiceGone)(e.message) from None
        except PeerGone as e:
            raise ServiceGone(f"{client.address}: {e}") from None
        except RequestTimeout:
            raise ServiceGone(
                f"{client.address} did not answer within {timeout} s (is it running?)"
            ) from None
        except ChannelClosed:
            raise QueueClosed("this queue client is closed") from None
        except WireError as e:  # a value the codec refuses: name the field, not the envelope
            msg = re.sub(r"`\$\[1\]\.columns\.([^.\[`]+)", r"field `\1`, at `$", str(e))
            raise SchemaError(msg.replace("cannot encode field", "field")) from None

    async def _unit(self, unit: int) -> AsyncClient:
        if unit >= len(self._units):
            info = await self._call(self._controller, "info", {}, _CONTROL_TIMEOUT)
            for address in info["units"][len(self._units) :]:
                self._units.append(AsyncClient(address, secret=self._secret))
        return self._units[unit]

    async def put(
        self,
        partition: str,
        data: dict[str, Any],
        *,
        meta: dict[str, Sequence[Any]] | None = None,
        indexes: Sequence[int] | None = None,
        partition_meta: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        """Store samples; returns their global indexes.

        ``data`` maps field names to columns (one row per sample); with
        ``indexes`` the fields are added to those existing samples. ``meta``
        maps keys to one value per sample; ``partition_meta`` is merged into the
        partition's meta. Waits (by event) for room when the queue is full.

        Raises:
            SchemaError: fields of different lengths, a kind or shape that
                differs from earlier puts, bad indexes or meta.
            PutTimeout: no room within ``timeout``.
            ServiceGone: the controller or a storage unit is unreachable.
        """
        _check_partition(partition)
        if not isinstance(data, dict) or not data:
            raise SchemaError(
                f"data: expected a dict of field name -> column, got {data!r:.60} "
                "(e.g. {'tokens': [...], 'rewards': torch.tensor([...])})"
            )
        rows = -1
        first = ""
        signatures = {}
        for name, column in data.items():
            if not isinstance(name, str):
                raise SchemaError(f"field {name!r}: expected a str name, got {type(name).__name__}")
            kind = kind_of(name, column)
            n = rows_of(column)
            if rows < 0:
                rows, first = n, name
            elif n != rows:
                raise SchemaError(
                    f"field `{name}`: expected {rows} rows (as field `{first}`), got {n} "
                    "(every field of one put must have the same number of samples)"
                )
            signatures[name] = signature(kind, column)
            if isinstance(column, list) and not all(type(v) in _PLAIN for v in column):
                try:  # plain values: refuse what cannot travel before anything is reserved
                    encode(column)
                except WireError as e:
                    raise SchemaError(
                        str(e).replace("cannot encode `", f"field `{name}`, at `", 1)
                    ) from None
        if rows == 0:
            raise SchemaError("data: expected at least one sample, got 0 rows")
        meta = dict(meta or {})
        for key, values in meta.items():
            if not isinstance(values, (list, tuple)) or len(values) != rows:
                got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
                raise SchemaError(
                    f"meta `{key}`: expected a list of {rows} values (one per sample), got {got}"
                )
            meta[key] = list(values)
        if indexes is not None:
            indexes = list(indexes)
            if len(indexes) != rows or not all(type(i) is int for i in indexes):
                raise SchemaError(
                    f"indexes: expected {rows} ints (one per row of data), got {indexes!r:.60}"
                )
            if len(set(indexes)) != rows:
                raise SchemaError(
                    f"indexes: expected {rows} distinct ints, got a repeated one in "
                    f"{indexes!r:.60} (one row of data per sample)"
                )
        alloc_args = {
            "partition": partition,
            "rows": rows,
            "signatures": signatures,
            "meta": meta,
            "partition_meta": partition_meta,
            "indexes": indexes,
            "timeout": timeout,
        }
        alloc_timeout = None if timeout is None else timeout + _CONTROL_TIMEOUT
        call = self._call(self._controller, "alloc", alloc_args, alloc_timeout)
        if not self._local:
            alloc = await call
        else:  # the one copy into shared memory runs while the controller places the put
            placing = asyncio.ensure_future(call)
            try:
                if sum(map(nbytes, data.values())) >= _STAGE_IN_THREAD:  # side by side:
                    moved = await asyncio.gather(  # tensors copied, strings packed
                        asyncio.to_thread(shared_tensor_columns, data),
                        asyncio.to_thread(packed_string_columns, data),
                    )
                    data = {**data, **moved[0], **moved[1]}
                else:
                    data = shared_columns(data)
            except BaseException:
                await self._abandon(placing, partition, indexes is None)
                raise
            alloc = await placing
        placed: list[int] = alloc["indexes"]
        units: list[int] = alloc["units"]
        blocks = _blocks(units)
        sends = []
        for unit, start, stop in blocks:
            columns = {name: split_rows(col, [start, stop])[0] for name, col in data.items()}
            client = await self._unit(unit)
            args = {"partition": partition, "indexes": placed[start:stop], "columns": columns}
            sends.append(self._call(client, "put", args, _CONTROL_TIMEOUT))
        try:  # each unit makes its rows visible at the controller once stored
            await asyncio.gather(*sends)
        except BaseException:
            if indexes is None:
                await self._give_back(partition, placed)
            raise
        return placed

    async def _abandon(self, placing: asyncio.Future[Any], partition: str, new: bool) -> None:
        """A put failed before its data moved: give back the samples it reserved."""
        try:
            alloc = await placing
        except QueueError:
            return  # nothing was reserved
        if new:
            await self._give_back(partition, alloc["indexes"])

    async def _give_back(self, partition: str, indexes: list[int]) -> None:
        """New samples that never became visible: their room goes back."""
        args = {"partition": partition, "indexes": indexes}
        await self._call(self._controller, "abort", args, _CONTROL_TIMEOUT)

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
        returns an empty batch.

        Raises:
            GetTimeout: too few ready samples within ``timeout``; nothing leased.
            UnknownTask, SchemaError: bad arguments.
            ServiceGone: the controller or a storage unit is unreachable.
        """
        _check_partition(partition)
        _positive("batch_size", batch_size)
        _positive("dp_size", dp_size)
        if type(dp_rank) is not int or not 0 <= dp_rank < dp_size:
            raise SchemaError(f"dp_rank: expected an int in [0, {dp_size}), got {dp_rank!r}")
        fields = list(fields)
        if not fields or not all(isinstance(f, str) for f in fields):
            raise SchemaError(f"fields: expected a non-empty list of field names, got {fields!r}")
        chosen = sampler_from(sampler)
        key = (partition, task, dp_rank, dp_size)
        number = self._batches.get(key, 0)
        share = await self._call(
            self._controller,
            "get",
            {
                "partition": partition,
                "task": task,
                "fields": fields,
                "batch_size": batch_size,
                "dp_rank": dp_rank,
                "dp_size": dp_size,
                "batch": number,
                "sampler": msgspec.to_builtins(chosen),
                "timeout": timeout,
            },
            None if timeout is None else timeout + _CONTROL_TIMEOUT,
        )
        self._batches[key] = number + 1
        indexes: list[int] = share["indexes"]
        by_unit: dict[int, list[int]] = {}
        for pos, unit in enumerate(share["units"]):
            by_unit.setdefault(unit, []).append(pos)
        reads = []
        for unit, positions in by_unit.items():
            client = await self._unit(unit)
            args = {"indexes": [indexes[p] for p in positions], "fields": fields}
            reads.append(self._call(client, "read", args, _CONTROL_TIMEOUT))
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

    async def ack(self, batch: Batch) -> int:
        """Mark the batch consumed for its task; returns how many samples were newly consumed."""
        return int(
            await self._call(
                self._controller,
                "ack",
                {
                    "partition": batch.partition,
                    "task": batch.task,
                    "lease": batch.lease,
                    "indexes": batch.indexes,
                },
                _CONTROL_TIMEOUT,
            )
        )

    async def clear(self, partition: str) -> int:
        """Drop a partition and its data now, consumed or not; returns how many samples went."""
        _check_partition(partition)
        return int(
            await self._call(self._controller, "clear", {"partition": partition}, _CONTROL_TIMEOUT)
        )

    async def statistics(self) -> dict[str, Any]:
        """Depth per partition and task, leases, waiters, and per storage unit bytes and rates."""
        stats = await self._call(self._controller, "stats", {}, _CONTROL_TIMEOUT)
        units = []
        for u, alive in enumerate(stats.pop("storage_units_alive")):
            unit = await self._unit(u)
            one = {"alive": alive, "address": unit.address}
            if alive:
                try:
                    one.update(await self._call(unit, "stats", {}, _CONTROL_TIMEOUT))
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

    def __init__(self, address: str, *, secret: str | bytes | None = None) -> None:
        self._loop = wire_loop()
        self._client = AsyncQueueClient(address, secret=secret)
        self.address = address

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    def put(self, partition: str, data: dict[str, Any], **kw: Any) -> list[int]:
        return self._run(self._client.put(partition, data, **kw))

    def get(self, partition: str, **kw: Any) -> Batch:
        return self._run(self._client.get(partition, **kw))

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


put_doc = AsyncQueueClient.put.__doc__
QueueClient.put.__doc__ = put_doc
QueueClient.get.__doc__ = AsyncQueueClient.get.__doc__
QueueClient.ack.__doc__ = AsyncQueueClient.ack.__doc__
QueueClient.clear.__doc__ = AsyncQueueClient.clear.__doc__
QueueClient.statistics.__doc__ = AsyncQueueClient.statistics.__doc__
