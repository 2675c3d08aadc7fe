"""The queue's lifecycle: constructors that start, idempotent closes, closed errors, frozen
statistics, and the old names that still work for one release (with a warning)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import rlferry.queue
from rlferry.queue import AsyncQueueClient, Queue, QueueClient, QueueClosed, QueueConfig
from rlferry.queue.services import ControllerService, StorageService, StorageUnit
from rlferry.queue.statistics import (
    ControllerStatistics,
    PartitionStatistics,
    QueueStatistics,
    StorageStatistics,
    StorageUnitStatistics,
)


def test_the_constructor_starts_an_embedded_queue():
    with Queue(storage_units=1, tasks=("train",)) as q, q.client() as c:
        c.put("p", {"x": torch.arange(3.0)})
        b = c.get("p", task="train", batch_size=3, fields=["x"], timeout=5)
        assert torch.equal(b.data["x"], torch.arange(3.0))


def test_queue_start_is_a_deprecated_alias_of_the_constructor():
    with pytest.warns(DeprecationWarning, match=r"Queue.start\(...\) is deprecated: use Queue"):
        q = Queue.start(storage_units=1, tasks=("a", "b"))
    with q, q.client() as c:
        assert c.put("p", {"x": torch.zeros(2)}) == [0, 1]


def test_a_second_close_does_nothing_and_a_closed_queue_refuses_calls():
    q = Queue(storage_units=1)
    c = q.client()
    q.close()
    q.close()
    c.close()  # closed with the queue: a second close does nothing
    with pytest.raises(QueueClosed, match="this queue is closed"):
        q.client()
    with pytest.raises(QueueClosed, match="this queue is closed"):
        q.statistics()
    with pytest.raises(QueueClosed, match="this queue client is closed"):
        c.put("p", {"x": torch.zeros(1)})


def test_a_closed_sync_client_raises_queue_closed():
    with Queue(storage_units=1) as q:
        c = QueueClient(q.address)
        c.statistics()
        with c:
            pass
        with pytest.raises(QueueClosed, match="this queue client is closed"):
            c.statistics()


def test_the_async_client_closes_with_async_with_and_its_old_close_warns():
    with Queue(storage_units=1, tasks=("train",)) as q:

        async def scenario() -> None:
            async with q.async_client() as c:
                await c.put("p", {"x": torch.zeros(2)})
            with pytest.raises(QueueClosed, match="this queue client is closed"):
                await c.put("p", {"x": torch.zeros(2)})
            await c.aclose()  # a second close does nothing
            old = q.async_client()
            with pytest.warns(DeprecationWarning, match=r"use `await AsyncQueueClient.aclose"):
                await old.close()
            with pytest.raises(QueueClosed):
                await old.statistics()

        asyncio.run(scenario())


def test_statistics_are_a_frozen_record_that_still_reads_like_the_old_dict():
    with Queue(storage_units=2, tasks=("train",)) as q, q.client() as c:
        c.put("p", {"x": torch.zeros(3, 2)})
        stats = c.statistics()
        assert isinstance(stats, QueueStatistics)
        assert stats.samples_held == 3 and stats.bytes_held == 3 * 2 * 4
        assert stats.partitions["p"] == PartitionStatistics(
            samples=3, tasks=stats.partitions["p"].tasks
        )
        assert stats.partitions["p"].tasks["train"].depth == 3
        assert all(isinstance(u, StorageUnitStatistics) and u.alive for u in stats.storage_units)
        assert q.statistics().samples_held == 3
        with pytest.raises(AttributeError):
            stats.samples_held = 0
        with pytest.warns(DeprecationWarning, match=r"read its attribute `.samples_held`"):
            assert stats["samples_held"] == 3
        with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
            stats["nope"]


def test_the_services_statistics_are_frozen_records_and_stats_is_deprecated():
    unit = StorageUnit()
    unit.store([0, 1], {"x": torch.zeros(2, 4)})
    stats = unit.statistics()
    assert stats == StorageStatistics(
        bytes_held=32,
        bytes_in=32,
        bytes_out=0,
        put_bytes_per_s=stats.put_bytes_per_s,
        get_bytes_per_s=0.0,
        samples=2,
    )
    assert stats.put_bytes_per_s > 0
    with pytest.warns(DeprecationWarning, match=r"use StorageUnit.statistics\(\)"):
        assert unit.stats()["samples"] == 2


def test_services_start_in_async_with_and_close_once():
    async def scenario() -> None:
        async with StorageService([None], None) as unit:
            (address,) = await unit.start()  # started on entry: a second start binds nothing
            config = QueueConfig(storage_units=1)
            async with ControllerService(config, [address], [None]) as ctrl:
                (controller,) = await ctrl.start()  # started on entry: its address again
                unit.link(controller)
                async with AsyncQueueClient(controller) as c:
                    await c.put("p", {"x": torch.zeros(2)})
                stats = ctrl.statistics()
                assert isinstance(stats, ControllerStatistics) and stats.samples_held == 2
                assert unit.statistics().samples == 2
                with pytest.warns(DeprecationWarning, match=r"use Controller.statistics\(\)"):
                    assert ctrl.controller.stats()["samples_held"] == 2
            await ctrl.aclose()
            with pytest.raises(QueueClosed, match="this controller service is closed"):
                await ctrl.start()
        await unit.aclose()
        with pytest.raises(QueueClosed, match="this storage service is closed"):
            await unit.start()
        with pytest.raises(QueueClosed, match="this storage unit is closed"):
            await unit.unit.handle({"op": "stats"}, b"")

    asyncio.run(scenario())


def test_names_that_left_the_public_surface_still_import_with_a_warning():
    assert len(rlferry.queue.__all__) <= 20
    for name, home in [
        ("ControllerService", "rlferry.queue.services"),
        ("StorageService", "rlferry.queue.services"),
        ("RemoteError", "rlferry.errors"),
    ]:
        with pytest.warns(DeprecationWarning, match=f"import it from {home}"):
            getattr(rlferry.queue, name)
    with pytest.warns(DeprecationWarning, match="a constant of AsyncQueueClient.get"):
        assert rlferry.queue.WARN_AFTER == 5.0
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        rlferry.queue.nope  # noqa: B018
