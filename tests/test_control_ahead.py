"""A batch taken ahead (``Coordinator.batch(trainer_version=...)``, while the trainer still
trains the step before), and the demo's batches taken that way (``rl._batches``)."""

import asyncio
import random

import pytest

from rlferry.control import Coordinator, CoordinatorTimeout, SamplingParams
from rlferry.queue import Queue
from rlferry.rl._batches import Batches
from rlferry.rl._producer import Producer
from rlferry.rl.faults import Engines
from rlferry.rl.task import ReverseTask

pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
from rlferry.engines.hf import HFEngine
from test_control import close_all, engines_with_sender, produce, tiny_model, update_to


@pytest.mark.parametrize(("eta", "stale"), [(1, "drop"), (2, "regenerate"), (2, "drop")])
def test_a_batch_taken_before_the_update_lags_no_more_than_max_staleness_when_trained(eta, stale):
    """Each step's batch is taken while the step before trains, for the version its update
    makes; every sample's lag behind the weights that train it stays within eta."""

    async def main():
        trainer, engines, sender = await engines_with_sender(2, "ahead")
        coord = Coordinator(engines, batch_size=4, max_staleness=eta, stale=stale)
        producer = asyncio.ensure_future(produce(coord, random.Random(eta), longest=40))
        lags = []
        try:
            batch = await coord.batch(2, timeout=60)
            for step in range(1, 6):
                trained_by = step - 1  # the weights that train this step's batch
                lags += [trained_by - min(c.versions) for g in batch for c in g.completions]
                ahead = await coord.batch(2, timeout=60, trainer_version=coord.version + 1)
                await update_to(coord, sender, trainer, step, timeout=60)
                batch = ahead
        finally:
            producer.cancel()
            await close_all(coord, engines, sender)
        assert lags and max(lags) <= eta
        stats = coord.statistics()
        assert stats.staleness_max <= eta and stats.consumed == 6 * 4

    asyncio.run(main())


def test_a_batch_for_weights_older_than_the_version_is_refused():
    async def main():
        engine = HFEngine(tiny_model(0), name="e0")
        async with Coordinator([engine], batch_size=2, max_staleness=1, version=3) as coord:
            for bad in (2, "4", 3.0):
                with pytest.raises(ValueError) as e:
                    await coord.batch(1, timeout=1, trainer_version=bad)
                assert str(e.value) == (
                    f"trainer_version: expected None or an int >= the version (3), got "
                    f"{bad!r} (the version of the weights that will train the batch: None "
                    "for those now, 4 to take it before the update)"
                )
        engine.close()

    asyncio.run(main())


def test_a_submit_waiting_for_room_goes_on_once_a_batch_drops_stale_groups():
    """Dropping stale groups makes room in the bound: a submit waiting for it is woken."""

    async def main():
        engine = HFEngine(tiny_model(0), name="e0")
        coord = Coordinator([engine], batch_size=2, max_staleness=1)
        params = SamplingParams(max_tokens=4)
        done = [await coord.submit([1, 2, 3], params, n=2, group=g) for g in range(2)]
        await asyncio.gather(*done)  # the bound is full: 2 x 2 samples at version 0
        waiting = asyncio.ensure_future(coord.submit([1, 2, 3], params, n=2, timeout=30))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        with pytest.raises(CoordinatorTimeout):  # for version 2 both groups lag 2 > 1
            await coord.batch(1, timeout=0.5, trainer_version=2)
        assert waiting.done()  # admitted when the groups were dropped, not at its timeout
        await (await waiting)  # its group generated (and, finished in the wait, dropped)
        assert coord.statistics().dropped in (4, 6)
        await coord.aclose()
        engine.close()

    asyncio.run(main())


async def _batches(groups: int = 2, size: int = 2):
    """The demo's batches over a real engine, coordinator and queue (no weight sync)."""
    task = ReverseTask()
    engine = HFEngine(tiny_model(0), name="e0")
    coord = Coordinator([engine], batch_size=groups * size, max_staleness=2)

    async def never(i):
        raise AssertionError("no engine is lost in this test")

    async def ended(i, handle):
        await asyncio.Event().wait()

    slots = Engines([engine], start=never, ended=ended, weights=None)
    slots.attach(coord)
    produced = Producer(task, seed=0)
    params = SamplingParams(max_tokens=task.max_tokens, temperature=1.0)
    producer = asyncio.ensure_future(produced.run(coord, params, size))
    queue = Queue()
    client = queue.async_client()
    batches = Batches(slots, coord, produced, client, groups=groups, group_size=size, sync=False)

    async def close():
        batches.cancel()
        producer.cancel()
        await slots.close()
        await coord.aclose()
        await client.aclose()
        queue.close()
        engine.close()

    return batches, coord, client, close


@pytest.mark.parametrize("first_run", [False, True])
def test_a_batch_taken_ahead_is_the_steps_batch_once(first_run):
    """``first_run``: the batch taken ahead ran (took its groups) before the step asked for
    it; else the step asks first and waits for it. Either way one batch is consumed and its
    rows are the partition's."""

    async def main():
        batches, coord, client, close = await _batches()
        try:
            taken = await batches.take(1)
            while coord.statistics().ready_groups < 2:  # step 2's groups are ready
                await asyncio.sleep(0.01)
            batches.ahead(2)
            if first_run:
                await asyncio.sleep(0)
            second = await batches.take(2)
            stats = coord.statistics()
            assert stats.consumed == 2 * 4
            assert len(taken.uids) == len(second.uids) == 4
            assert not set(taken.uids) & set(second.uids)
            got = await client.get(
                "train_2", task="train", batch_size=4, fields=["advantages"], timeout=10
            )
            assert len(got.data["advantages"]) == 4
            assert max(second.lags) <= 2
        finally:
            await close()

    asyncio.run(main())
