"""HFEngine's staged pushes (``stage_pushes``, CUDA's default): a push that comes while a
step runs is copied aside and commits at once; the step in progress ends on the old
weights and the copies load before the next step. The steps here are held on purpose (the
model's forward waits on an event), so that a push always comes mid-step."""

import asyncio
import threading

import pytest

from rlferry.weights import WeightSyncError

pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
from test_engine_hf import tiny_model
from test_engine_hf_weights import joined, long_and_clock, push, same_weights


class Held:
    """A model whose forward passes wait while ``hold()`` holds them, until ``release()``;
    ``entered`` is set once a held forward began."""

    def __init__(self, model):
        self.entered, self._gate, self._holding = threading.Event(), threading.Event(), False
        forward = model.forward

        def held(*args, **kwargs):
            if self._holding:
                self.entered.set()
                assert self._gate.wait(60), "the test never released the step"
            return forward(*args, **kwargs)

        model.forward = held
        self.model = model

    def hold(self):
        self._gate.clear()
        self.entered.clear()
        self._holding = True

    def release(self):
        self._holding = False
        self._gate.set()


def test_a_push_during_a_step_commits_at_once_and_loads_when_the_step_ends():
    original, trainer = tiny_model(0).state_dict(), tiny_model(1).state_dict()
    held = Held(tiny_model(0))

    async def main():
        engine, sender = await joined(held.model, "staged", stage_pushes=True)
        with engine, sender:
            task = await long_and_clock(engine, 60)
            held.hold()
            assert await asyncio.to_thread(held.entered.wait, 60)
            report = await push(sender, trainer, 1)  # the step is still held: not waited for
            assert not task.done() and await engine.get_weight_version() == 1
            assert same_weights(engine, original)  # the step in progress reads these
            held.release()
            done = await task
            assert same_weights(engine, trainer)  # loaded before the next step
            return report, done

    report, done = asyncio.run(main())
    assert report.receivers == ("e",)
    k = done.versions.index(1)
    assert 4 <= k < 60 and done.versions == [0] * k + [1] * (60 - k)


def test_a_staged_push_that_fails_leaves_the_model_as_it_was_until_a_whole_version():
    original, good = tiny_model(0).state_dict(), tiny_model(1).state_dict()
    bad = {k: v.clone() for k, v in good.items()}
    bad["lm_head.weight"][3, 5] = float("nan")  # in the last bucket: earlier ones staged
    held = Held(tiny_model(0))

    async def main():
        engine, sender = await joined(
            held.model, "staged-fail", bucket_bytes=16384, check_finite=True, stage_pushes=True
        )
        with engine, sender:
            task = await long_and_clock(engine, 60)
            held.hold()
            assert await asyncio.to_thread(held.entered.wait, 60)
            with pytest.raises(WeightSyncError) as e:
                await push(sender, bad, 1)
            assert "NonFinite" in str(e.value)
            held.release()
            stats = await engine.statistics()
            assert stats.paused and stats.version == 0  # refusing until a whole version
            assert same_weights(engine, original)  # the staged buckets were dropped
            await push(sender, good, 2)
            assert same_weights(engine, good)
            return await task

    done = asyncio.run(main())
    assert set(done.versions) == {0, 2} and done.versions == sorted(done.versions)


def test_a_push_after_a_staged_one_waits_for_the_step_that_loads_it():
    first, second = tiny_model(1).state_dict(), tiny_model(2).state_dict()
    held = Held(tiny_model(0))

    async def main():
        engine, sender = await joined(held.model, "staged-twice", stage_pushes=True)
        with engine, sender:
            task = await long_and_clock(engine, 60)
            held.hold()
            assert await asyncio.to_thread(held.entered.wait, 60)
            await push(sender, first, 1)
            # version 1 is staged, not loaded: version 2 waits for the held step to end
            # (its load of version 1 first), then loads in place
            later = asyncio.ensure_future(push(sender, second, 2))
            assert await engine.get_weight_version() == 1
            held.release()
            await later  # loaded in place, or staged if it came during the next step
            done = await task
            assert same_weights(engine, second)
            assert await engine.fingerprint() == await engine.fingerprint()
            return done

    done = asyncio.run(main())
    assert done.versions == sorted(done.versions) and done.versions[-1] == 2
    assert set(done.versions) <= {0, 1, 2}
