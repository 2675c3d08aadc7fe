"""A batch taken ahead (``Coordinator.batch(trainer_version=...)``, while the trainer still
trains the step before), and the room that dropping stale groups makes."""

import asyncio
import random

import pytest

from rlferry.control import Coordinator, CoordinatorTimeout, SamplingParams

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
