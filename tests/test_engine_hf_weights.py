"""HFEngine and the weight plane: a real WeightSender (shm) pushes a trainer's state dict.

Versions are per token; a version is served only once committed whole; a push that
fails midway leaves the engine refusing to step until a whole version commits.
"""

import asyncio
import random

import pytest
import torch

from rlferry.control import EngineError, GenerateRequest, SamplingParams
from rlferry.weights import WeightSender, WeightSyncError

pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
from rlferry.engines.hf import HFEngine
from test_engine_hf import tiny_model

PROMPT = [10, 11, 12, 13, 14, 15, 16, 17]


def req(rid, max_tokens, prompt=PROMPT):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return GenerateRequest(request_id=rid, prompt_ids=prompt, params=params)


def same_weights(engine, state):
    params = engine.model.state_dict()
    return all(torch.equal(params[k], v) for k, v in state.items())


async def joined(model, group, *, bucket_bytes=None, **kw):
    """An engine of ``model`` joined to a fresh shm sender of ``group``."""
    engine = HFEngine(model, name="e", **kw)
    sender = WeightSender(group=group, transport="shm", bucket_bytes=bucket_bytes)
    await engine.init_weight_transfer(group, sender.address)
    return engine, sender


async def push(sender, state, version):
    return await asyncio.to_thread(sender.push, state.items(), version=version, timeout=30)


async def long_and_clock(engine, long):
    task = asyncio.ensure_future(engine.generate(req("long", long)))
    await engine.generate(req("clock", 4, prompt=[7, 8, 9]))
    return task


def test_an_update_during_generation_changes_the_version_of_the_tokens_after_it():
    trainer = tiny_model(1).state_dict()

    async def main():
        engine, sender = await joined(tiny_model(0), "update")
        with engine, sender:
            assert await engine.get_weight_version() == 0
            task = await long_and_clock(engine, 40)
            await engine.pause("keep")
            await engine.start_weight_update()
            report = await push(sender, trainer, 1)
            await engine.finish_weight_update(1)
            assert await engine.get_weight_version() == 1
            assert same_weights(engine, trainer)  # bit for bit
            await engine.resume()
            done = await task
            stats = await engine.statistics()
        return done, report, stats

    done, report, stats = asyncio.run(main())
    assert report.receivers == ("e",)
    k = done.versions.index(1)
    assert k >= 4 and done.versions == [0] * k + [1] * (40 - k)
    assert (stats.version, stats.updates, stats.paused, stats.last_error) == (1, 1, False, None)
    assert stats.update_seconds > 0 and stats.paused_seconds >= stats.update_seconds


def test_a_slot_cache_engine_decodes_with_the_weights_pushed_in_place():
    """The slot cache (CUDA's default; its steps are CUDA graphs there) reads the weights
    where they are: after an update, its tokens are those of an engine built with them."""
    trainer = tiny_model(1)

    async def main():
        engine, sender = await joined(tiny_model(0), "slots", kv_cache="slots")
        with engine, sender:
            task = await long_and_clock(engine, 40)
            await engine.pause("keep")
            await engine.start_weight_update()
            await push(sender, trainer.state_dict(), 1)
            await engine.finish_weight_update(1)
            await engine.resume()
            done = await task
            fresh = await engine.generate(req("fresh", 12))
        with HFEngine(trainer, kv_cache="dynamic") as reference:
            want = await reference.generate(req("fresh", 12))
        return done, fresh, want

    done, fresh, want = asyncio.run(main())
    k = done.versions.index(1)
    assert k >= 4 and done.versions == [0] * k + [1] * (40 - k)
    assert fresh.token_ids == want.token_ids
    assert fresh.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_a_bare_push_during_generation_never_steps_on_a_mix_of_versions():
    """No pause, no start_weight_update: the push's first bucket stops stepping and its
    commit serves the new version. Every token of version 0 is the uninterrupted run's,
    bit for bit (a step over half-loaded weights would change its logprob)."""
    first, second = tiny_model(1).state_dict(), tiny_model(2).state_dict()

    async def main():
        engine, sender = await joined(tiny_model(0), "bare", bucket_bytes=8192)
        with engine, sender:
            await push(sender, first, 1)  # the plan travels once; version 2 is quick
            reference = await (await long_and_clock(engine, 200))
            task = await long_and_clock(engine, 200)
            await push(sender, second, 2)
            assert await engine.get_weight_version() == 2 and same_weights(engine, second)
            return reference, await task

    reference, done = asyncio.run(main())
    k = done.versions.index(2)
    assert 4 <= k < 200 and done.versions == [1] * k + [2] * (200 - k)
    assert done.token_ids[:k] == reference.token_ids[:k]
    assert done.logprobs[:k] == reference.logprobs[:k]


def test_a_push_that_fails_midway_leaves_the_engine_refusing_until_a_whole_version():
    """check_finite refuses a NaN in the last bucket: the earlier buckets were loaded,
    the model holds a mix, so nothing generates until version 2 commits whole."""
    good = tiny_model(1).state_dict()
    bad = {k: v.clone() for k, v in good.items()}
    bad["lm_head.weight"][3, 5] = float("nan")

    async def main():
        engine, sender = await joined(tiny_model(0), "fail", bucket_bytes=16384, check_finite=True)
        with engine, sender:
            await engine.pause()
            await engine.start_weight_update()
            with pytest.raises(WeightSyncError) as e:
                await push(sender, bad, 1)
            assert list(e.value.failures) == ["e"]
            with pytest.raises(EngineError) as e2:
                await engine.finish_weight_update(1)
            await engine.resume()
            assert await engine.is_paused()  # refusing: a mix is never served
            waiting = asyncio.ensure_future(engine.generate(req("r", 6)))
            await asyncio.sleep(0)
            assert await engine.abort_requests(["nobody"]) == 0  # a round trip of its thread
            stats = await engine.statistics()
            assert (stats.paused, stats.waiting, stats.steps, stats.version) == (True, 1, 0, 0)
            await push(sender, good, 2)  # a bare push of a whole version
            done = await waiting
            assert not await engine.is_paused() and same_weights(engine, good)
            return str(e2.value), stats.last_error, done

    error, last_error, done = asyncio.run(main())
    load_error = (
        "NonFinite: tensor `lm_head.weight`: expected finite values, got NaN or Inf "
        "(check_finite; did the trainer diverge?)"
    )
    assert error == (
        "engine `e`: finish_weight_update(1): expected version 1 committed whole, got "
        "version 0 and a push loaded in part (the model holds a mix) (the load failed: "
        f"{load_error}); no step runs until a version commits whole (push it again)"
    )
    assert last_error == error.removeprefix("engine `e`: ")
    assert done.versions == [2] * 6


def test_a_bare_push_that_fails_midway_stops_the_engine_with_the_reason():
    good = tiny_model(1).state_dict()
    bad = {k: v.clone() for k, v in good.items()}
    bad["lm_head.weight"][0, 0] = float("inf")

    async def main():
        engine, sender = await joined(tiny_model(0), "bare-fail", bucket_bytes=16384,
                                      check_finite=True)  # fmt: skip
        with engine, sender:
            task = await long_and_clock(engine, 200)
            with pytest.raises(WeightSyncError):
                await push(sender, bad, 1)
            stats = await engine.statistics()
            assert stats.paused and stats.running == 1 and not task.done()
            await push(sender, good, 2)
            return stats.last_error, await task

    last_error, done = asyncio.run(main())
    assert last_error.startswith("weights: a push failed after ")
    assert last_error.endswith(
        "of its buckets were loaded (NonFinite: tensor `lm_head.weight`: expected finite "
        "values, got NaN or Inf (check_finite; did the trainer diverge?)); the model holds "
        "a mix of versions: no step runs until a version commits whole"
    )
    assert set(done.versions) == {0, 2}  # never 1: it never committed


def test_a_push_refused_at_its_first_bucket_leaves_the_model_whole_and_serving():
    bad = {k: v.clone() for k, v in tiny_model(1).state_dict().items()}
    bad["model.embed_tokens.weight"][0, 0] = float("nan")
    model = tiny_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    async def main():
        engine, sender = await joined(model, "first", bucket_bytes=16384, check_finite=True)
        with engine, sender:
            with pytest.raises(WeightSyncError):
                await push(sender, bad, 1)
            assert not await engine.is_paused()
            done = await engine.generate(req("r", 5))
            return done, await engine.statistics()

    done, stats = asyncio.run(main())
    assert done.versions == [0] * 5 and same_weights_of(model, before)
    assert stats.last_error == (
        "weights: a push was refused before loading (tensor `model.embed_tokens.weight`: "
        "expected finite values, got NaN or Inf (check_finite; did the trainer diverge?))"
    )


def same_weights_of(model, state):
    return all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_finish_weight_update_of_a_version_that_never_came_raises_and_refuses():
    trainer = tiny_model(1).state_dict()

    async def main():
        engine, sender = await joined(tiny_model(0), "never")
        with engine, sender:
            await engine.start_weight_update()
            with pytest.raises(EngineError) as e:
                await engine.finish_weight_update(3)
            assert await engine.is_paused()
            await push(sender, trainer, 3)
            assert not await engine.is_paused()
            done = await engine.generate(req("r", 3))
            return str(e.value), done

    error, done = asyncio.run(main())
    assert error == (
        "engine `e`: finish_weight_update(3): expected version 3 committed whole, got "
        "version 0; no step runs until a version commits whole (push it again)"
    )
    assert done.versions == [3] * 3


def test_finish_weight_update_without_a_weight_transfer_names_the_missing_call():
    async def main():
        with HFEngine(tiny_model(0), name="e", version=4) as engine:
            await engine.start_weight_update()
            await engine.finish_weight_update(4)  # the version served: nothing to do
            assert not await engine.is_paused()
            with pytest.raises(EngineError) as e:
                await engine.finish_weight_update(5)
            return str(e.value)

    assert asyncio.run(main()) == (
        "engine `e`: finish_weight_update(5): expected version 5 committed whole, got "
        "version 4 (no weight transfer: call init_weight_transfer); no step runs until a "
        "version commits whole (push it again)"
    )


def test_a_push_of_another_layout_is_rejected_before_any_bucket_moves():
    wrong = tiny_model(1).state_dict()
    wrong["lm_head.weight"] = torch.zeros(65, 64)

    async def main():
        engine, sender = await joined(tiny_model(0), "layout")
        with engine, sender:
            with pytest.raises(WeightSyncError) as e:
                await push(sender, wrong, 1)
            assert not await engine.is_paused()
            return e.value.failures["e"], await engine.generate(req("r", 3))

    error, done = asyncio.run(main())
    assert error == (
        "rejected the plan: 1 of 21 tensors differ from the receiver's parameters: "
        "`lm_head.weight`: expected shape [64, 64] float32, got shape [65, 64] float32"
    )
    assert done.versions == [0] * 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_pauses_aborts_and_pushes_end_every_request_and_never_mix(seed):
    """A random run: requests come and go while pauses of every mode, resumes, aborts,
    cancels and pushes (coordinated and bare) interleave. Every request ends (none
    hangs), within its max_tokens, its versions never go down, and only committed
    versions appear."""
    rng = random.Random(seed)
    states = {v: tiny_model(v).state_dict() for v in (1, 2, 3, 4)}

    async def main():
        engine, sender = await joined(tiny_model(0), f"random-{seed}", bucket_bytes=8192)
        with engine, sender:
            tasks = {}
            version = 0
            for i in range(40):
                params = SamplingParams(
                    max_tokens=rng.randint(1, 30), temperature=rng.choice([0.0, 1.0]), seed=i
                )
                prompt = [rng.randrange(64) for _ in range(rng.randint(1, 12))]
                tasks[f"r{i}"] = (params.max_tokens, asyncio.ensure_future(
                    engine.generate(GenerateRequest(request_id=f"r{i}", prompt_ids=prompt,
                                                    params=params))
                ))  # fmt: skip
                action = rng.random()
                if action < 0.15:
                    await engine.pause(rng.choice(["keep", "abort", "wait"]))
                    assert await engine.is_paused()
                    await engine.resume()
                elif action < 0.25 and version < 4:
                    version += 1
                    await engine.pause(rng.choice(["keep", "abort", "wait"]))
                    await engine.start_weight_update()
                    await push(sender, states[version], version)
                    await engine.finish_weight_update(version)
                    await engine.resume()
                elif action < 0.35 and version < 4:
                    version += 1
                    await push(sender, states[version], version)  # bare
                elif action < 0.45:
                    await engine.abort_requests(rng.sample(sorted(tasks), k=min(3, len(tasks))))
                elif action < 0.5:
                    tasks[f"r{i}"][1].cancel()
                await asyncio.sleep(0)
            done = await asyncio.wait_for(
                asyncio.gather(*(t for _, t in tasks.values()), return_exceptions=True), 60
            )
            return [(n, d) for (n, _), d in zip(tasks.values(), done, strict=True)], version

    results, last = asyncio.run(main())
    for max_tokens, done in results:
        if isinstance(done, asyncio.CancelledError):
            continue
        assert len(done.token_ids) <= max_tokens
        assert done.finish_reason in ("stop", "length", "abort")
        assert done.finish_reason != "length" or len(done.token_ids) == max_tokens
        assert done.versions == sorted(done.versions) and set(done.versions) <= set(range(last + 1))
