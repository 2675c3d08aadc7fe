"""The coordinator against real engines: staleness, weight updates, failures, restarts."""

import asyncio
import random

import pytest
import torch

from rlferry import errors
from rlferry.control import (
    ControlError,
    Coordinator,
    CoordinatorTimeout,
    EngineClosed,
    EngineError,
    EngineGone,
    SamplingParams,
    WeightUpdateError,
)
from rlferry.weights import WeightSender

transformers = pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
from rlferry.engines.hf import HFEngine  # noqa: E402

VOCAB = 32


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def run(coro):
    return asyncio.run(coro)


async def engines_with_sender(n: int, group: str = "control"):
    """``n`` engines of one model (its copies), joined to one shm sender."""
    trainer = tiny_model(0)
    engines = [HFEngine(tiny_model(0), name=f"e{i}") for i in range(n)]
    sender = WeightSender(group=group, transport="shm", receivers=n)
    for engine in engines:
        await engine.init_weight_transfer(group, sender.address)
    return trainer, engines, sender


def perturbed(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * step)
    return model.state_dict()


async def produce(coord, rng, longest=60):
    """Submit groups of 2 samples of random prompts forever: long and short rollouts, so
    that updates land while some are running."""
    k = 0
    while True:
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 6))]
        params = SamplingParams(max_tokens=rng.randrange(4, longest), temperature=1.0)
        await coord.submit(prompt, params, n=2, group=k)
        k += 1


async def update_to(coord, sender, trainer, step, **kw):
    """The trainer steps (its weights perturbed) and the coordinator pushes version ``step``."""
    state = perturbed(trainer, step)
    await coord.update_weights(
        lambda t: sender.push(state.items(), version=step, timeout=t), version=step, **kw
    )


async def close_all(coord, engines, sender):
    await coord.aclose()
    for engine in engines:
        engine.close()
    sender.close()


@pytest.mark.parametrize(("eta", "stale"), [(0, "drop"), (1, "regenerate"), (2, "drop")])
def test_no_consumed_sample_lags_more_than_max_staleness(eta, stale):
    async def main():
        trainer, engines, sender = await engines_with_sender(2)
        rng = random.Random(eta)
        coord = Coordinator(engines, batch_size=4, max_staleness=eta, stale=stale)

        producer = asyncio.ensure_future(produce(coord, rng))
        lags = []
        spanned = 0
        try:
            for step in range(1, 6):
                groups = await coord.batch(2, timeout=60)
                for g in groups:
                    for c in g.completions:
                        assert c.versions, "every sample has tokens"
                        lags.append(coord.version - min(c.versions))
                        spanned += len(set(c.versions)) > 1
                await asyncio.sleep(rng.uniform(0, 0.05))  # the trainer's step
                mode = rng.choice(["keep", "abort", "wait"])
                await update_to(coord, sender, trainer, step, mode=mode, timeout=60)
        finally:
            producer.cancel()
            await close_all(coord, engines, sender)
        assert lags and max(lags) <= eta
        stats = coord.statistics()
        assert stats.staleness_max <= eta and stats.consumed == 5 * 4
        # Whether a rollout spans an update here depends on the machine's speed (the bound
        # may be full of finished samples when the trainer updates); tokens of two versions
        # in one rollout are tested step by step in test_engine_hf_weights.py and below.
        if eta == 0:  # synchronous: nothing generates during an update, no token is stale
            assert set(lags) == {0} and not spanned

    run(main())


def test_an_engine_whose_load_raises_is_named_and_the_others_serve_the_new_version():
    async def main():
        trainer = tiny_model(0)
        good = HFEngine(tiny_model(0), name="good")
        picky = HFEngine(tiny_model(0), name="picky", check_finite=True)  # refuses NaN weights
        sender = WeightSender(group="fail", transport="shm", receivers=2)
        for engine in (good, picky):
            await engine.init_weight_transfer("fail", sender.address)
        coord = Coordinator([good, picky], batch_size=2, max_staleness=1)
        state = perturbed(trainer, 1)
        state["lm_head.weight"][0, 0] = float("nan")
        try:
            with pytest.raises(EngineError) as e:
                await coord.update_weights(
                    lambda t: sender.push(state.items(), version=1, timeout=t), version=1,
                    timeout=10,
                )  # fmt: skip
            assert e.value.engine == "picky" and isinstance(e.value, WeightUpdateError)
            assert e.value.stage == "push" and list(e.value.failures) == ["picky"]
            assert str(e.value).startswith(
                "engine `picky`: weight update to version 1 failed at push: `picky`: push: "
                "load raised NonFinite: tensor `lm_head.weight`: expected finite values, got "
                "NaN or Inf"
            )
            assert str(e.value).endswith("; 1 engine(s) serve version 1: good")
            assert await good.get_weight_version() == 1 and coord.version == 1
            assert await picky.get_weight_version() == 0
            stats = coord.statistics()
            assert stats.engines_serving == 1  # the picky one gets no rollouts meanwhile
            group = await (await coord.submit([1, 2, 3], SamplingParams(max_tokens=3), n=2))
            assert {c.engine for c in group.completions} == {"good"}
            assert all(v == 1 for c in group.completions for v in c.versions)
        finally:
            await close_all(coord, [good, picky], sender)

    run(main())


def test_a_restored_coordinator_keeps_staleness_bounded():
    async def main():
        trainer, engines, sender = await engines_with_sender(1, "restart")
        coord = Coordinator(engines, batch_size=2, max_staleness=1)
        params = SamplingParams(max_tokens=4)
        for step in range(1, 4):
            for k in range(2):
                await coord.submit([1, 2], params, group=k)
            await coord.batch(2, timeout=30)
            await update_to(coord, sender, trainer, step, timeout=30)
        saved = coord.state_dict()
        await coord.aclose()
        again = Coordinator(engines, batch_size=2, max_staleness=1)
        fresh = again.statistics().capacity
        again.load_state_dict(saved)
        stats = again.statistics()
        assert saved["version"] == 3 and stats.version == 3 and stats.consumed == 6
        # (eta + 1) x batch_size ahead of the trainer, not (eta + v + 1) x batch_size
        assert fresh == 4 and stats.capacity == 4
        with pytest.raises(TimeoutError):
            for k in range(5):  # the fifth sample finds no room
                await again.submit([1, 2], params, group=k, timeout=0.5)
        await close_all(again, engines, sender)

    run(main())


NOWHERE = "http://127.0.0.1:9"  # an engine never asked anything in these tests


def test_bad_coordinator_arguments_are_refused():
    with pytest.raises(ValueError) as e:
        Coordinator([NOWHERE], batch_size=0)
    assert str(e.value) == "batch_size: expected an int >= 1, got 0"
    with pytest.raises(ValueError) as e:
        Coordinator([NOWHERE], batch_size=2, max_staleness=-1)
    assert str(e.value) == "max_staleness: expected an int >= 0 (0 = synchronous), got -1"
    with pytest.raises(ValueError) as e:
        Coordinator([NOWHERE], batch_size=2, stale="keep")
    assert str(e.value) == "stale: expected 'drop' or 'regenerate', got 'keep'"
    with pytest.raises(TypeError) as e:
        Coordinator([object()], batch_size=2)  # type: ignore[list-item]
    assert str(e.value).startswith("engine: expected an rlferry.control.Engine")


def test_an_abort_mode_update_continues_each_rollout_from_its_partial_tokens():
    async def main():
        greedy = SamplingParams(max_tokens=60, temperature=0.0)
        alone = HFEngine(tiny_model(0), name="alone")
        from rlferry.control import GenerateRequest

        want = await alone.generate(
            GenerateRequest(request_id="w", prompt_ids=[5, 6, 7], params=greedy)
        )
        alone.close()
        trainer, engines, sender = await engines_with_sender(1, "partial")
        coord = Coordinator(engines, batch_size=2, max_staleness=1)
        try:
            pending = await coord.submit([5, 6, 7], greedy)
            clock = await coord.submit([1, 2], SamplingParams(max_tokens=8, temperature=0.0))
            await clock  # 8 decode steps done: the long rollout is under way, far from its end
            same = trainer.state_dict()  # the same weights: the tokens must not change
            await coord.update_weights(
                lambda t: sender.push(same.items(), version=1, timeout=t), version=1,
                mode="abort", timeout=30,
            )  # fmt: skip
            (got,) = (await pending).completions
            assert got.token_ids == want.token_ids and got.finish_reason == "length"
            assert set(got.versions) == {0, 1}  # begun before the update, ended after it
            assert got.versions == sorted(got.versions)
        finally:
            await close_all(coord, engines, sender)

    run(main())


class Counted(HFEngine):
    """An HFEngine that counts the coordinator's control calls to it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    async def pause(self, mode="keep"):
        self.calls.append("pause")
        return await super().pause(mode)

    async def start_weight_update(self):
        self.calls.append("start_weight_update")
        return await super().start_weight_update()

    async def finish_weight_update(self, version):
        self.calls.append("finish_weight_update")
        return await super().finish_weight_update(version)

    async def resume(self):
        self.calls.append("resume")
        return await super().resume()


def test_a_keep_update_of_engines_that_load_between_steps_is_the_push_alone():
    """An HFEngine stops its own steps for a push: in ``keep`` mode the update is the push
    (no pause, start, finish or resume), a rollout in flight goes on through it (its later
    tokens on the new version) and the engines serve the trainer's weights bit for bit;
    in ``wait`` mode the engines are paused and resumed as before."""

    async def main():
        from rlferry.weights import fingerprint

        trainer = tiny_model(0)
        engines = [Counted(tiny_model(0), name=f"e{i}") for i in range(2)]
        sender = WeightSender(group="inflight", transport="shm", receivers=2)
        for engine in engines:
            await engine.init_weight_transfer("inflight", sender.address)
        coord = Coordinator(engines, batch_size=2, max_staleness=1)
        try:
            assert (await engines[0].statistics()).loads_between_steps
            long = await coord.submit([5, 6, 7], SamplingParams(max_tokens=60, temperature=0))
            clock = await coord.submit([1, 2], SamplingParams(max_tokens=8, temperature=0))
            await clock  # the long rollout is under way
            new = perturbed(trainer, 1)
            report = await coord.update_weights(
                lambda t: sender.push(new.items(), version=1, timeout=t), version=1, timeout=30
            )  # fmt: skip
            assert [e.calls for e in engines] == [[], []]
            assert report.pause_seconds < report.push_seconds
            assert [await e.get_weight_version() for e in engines] == [1, 1]
            want = fingerprint(list(new.items()))
            assert [await e.fingerprint() for e in engines] == [want, want]
            (got,) = (await long).completions
            assert len(got.token_ids) == 60 and set(got.versions) == {0, 1}
            assert got.versions == sorted(got.versions)
            assert coord.statistics().version == 1
            new = perturbed(trainer, 2)
            await coord.update_weights(
                lambda t: sender.push(new.items(), version=2, timeout=t), version=2,
                mode="wait", timeout=30,
            )  # fmt: skip
            order = ["pause", "start_weight_update", "finish_weight_update", "resume"]
            assert [e.calls for e in engines] == [order, order]
            assert [await e.get_weight_version() for e in engines] == [2, 2]
            # a push given as a function that returns its coroutine is awaited too
            new = perturbed(trainer, 3)
            await coord.update_weights(
                lambda t: asyncio.to_thread(sender.push, new.items(), version=3, timeout=t),
                version=3, timeout=30,
            )  # fmt: skip
            assert [await e.get_weight_version() for e in engines] == [3, 3]
            want = fingerprint(list(new.items()))
            assert [await e.fingerprint() for e in engines] == [want, want]
        finally:
            await close_all(coord, engines, sender)

    run(main())


def test_finished_groups_go_into_the_queue_with_their_versions():
    from rlferry.control import put_groups
    from rlferry.queue import GrpoGroups, Queue

    async def main(q):
        _, engines, sender = await engines_with_sender(1, "toq")
        coord = Coordinator(engines, batch_size=4, max_staleness=1)
        client = q.async_client()
        try:
            params = SamplingParams(max_tokens=5, temperature=1.0, seed=1)
            for k in range(2):
                await coord.submit([1, 2, 3 + k], params, n=2, group=f"g{k}")
            groups = await coord.batch(2, timeout=30)
            idx = await put_groups(client, "train_0", groups)
            batch = await client.get(
                "train_0", task="train", batch_size=4, sampler=GrpoGroups(group_size=2),
                fields=["prompt_ids", "response_ids", "logprobs", "versions"], timeout=10,
            )  # fmt: skip
            assert sorted(batch.indexes) == sorted(idx)
            flat = [c for g in groups for c in g.completions]
            by_index = dict(zip(idx, flat, strict=True))
            for row, i in enumerate(batch.indexes):
                c = by_index[i]
                assert batch.data["response_ids"][row].tolist() == c.token_ids
                assert batch.data["versions"][row].tolist() == c.versions
                assert batch.data["logprobs"][row].tolist() == pytest.approx(c.logprobs)
                assert batch.meta["version_start"][row] == c.version_start
                assert batch.meta["group"][row] in ("g0", "g1")
        finally:
            await client.aclose()
            await close_all(coord, engines, sender)

    with Queue(storage_units=1, tasks=("train",)) as q:
        run(main(q))


def test_prometheus_metrics_read_the_coordinators_statistics():
    prometheus_client = pytest.importorskip("prometheus_client", reason="needs [prometheus]")
    from rlferry.control import register_metrics

    coord = Coordinator([NOWHERE], batch_size=4, max_staleness=2, version=3)
    registry = prometheus_client.CollectorRegistry()
    register_metrics(coord, registry)
    text = prometheus_client.generate_latest(registry).decode()
    assert "rlferry_version 3.0" in text
    assert "rlferry_capacity 24.0" in text  # (2 + 3 + 1) x 4
    assert "rlferry_dropped_total 0.0" in text


def test_async_with_closes_the_coordinator_and_a_call_after_aclose_raises_closed():
    async def main():
        async with Coordinator([NOWHERE], batch_size=4) as coord:
            assert coord.statistics().engines == 1
        await coord.aclose()  # a second close does nothing
        for call in (coord.batch(1), coord.submit([1, 2]), coord.remove_engine("x")):
            with pytest.raises(EngineClosed) as e:
                await call
            assert isinstance(e.value, errors.Closed)
        assert str(e.value) == (
            "engine `coordinator`: remove_engine after aclose() (make a new Coordinator)"
        )
        with pytest.raises(EngineClosed, match="add_engine after aclose"):
            coord.add_engine("http://127.0.0.1:9")
        assert coord.statistics().version == 0  # its state reads on

    run(main())


def test_a_call_waiting_on_the_coordinator_when_it_closes_raises_closed():
    async def main():
        coord = Coordinator([NOWHERE], batch_size=4)
        waiting = asyncio.ensure_future(coord.batch(1, timeout=30))
        await asyncio.sleep(0.05)
        await coord.aclose()
        with pytest.raises(EngineClosed) as e:
            await waiting
        assert str(e.value) == "engine `coordinator`: closed while waiting for 1 finished groups"

    run(main())


def test_coordinator_close_is_a_deprecated_alias_of_aclose():
    async def main():
        coord = Coordinator([NOWHERE], batch_size=4)
        with pytest.warns(
            DeprecationWarning,
            match=r"Coordinator.close\(\) is deprecated",
        ):
            await coord.close()
        with pytest.raises(EngineClosed):
            await coord.batch(1)

    run(main())


def test_the_control_planes_error_classes_are_of_their_base_and_their_families():
    from rlferry.engines import NotStarted

    families = {
        EngineError: (),
        EngineGone: (errors.Gone,),
        EngineClosed: (errors.Closed, errors.Gone, EngineGone),
        WeightUpdateError: (),
        CoordinatorTimeout: (errors.Timeout, TimeoutError),
        NotStarted: (errors.Closed, RuntimeError),
    }
    for cls, kinds in families.items():
        assert issubclass(cls, ControlError) and issubclass(cls, errors.RlferryError)
        assert all(issubclass(cls, k) for k in kinds), cls
    assert EngineClosed("e", "closed").gone
    assert not issubclass(CoordinatorTimeout, EngineError)  # no engine is at fault


def test_a_wait_of_the_coordinator_that_ends_raises_coordinator_timeout():
    async def main():
        async with Coordinator([NOWHERE], batch_size=4) as coord:
            with pytest.raises(CoordinatorTimeout) as e:
                await coord.batch(1, timeout=0.05)
            assert isinstance(e.value, TimeoutError) and isinstance(e.value, errors.Timeout)
            assert str(e.value) == (
                "1 finished groups: not within 0.05 s (0 of 1 engines serving: "
                "`http://127.0.0.1:9`: new: not asked for its state yet)"
            )

    run(main())
