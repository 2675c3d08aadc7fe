"""Faults belong to whoever caused them: a failed push, a bad request, an engine gone.

Each case runs on engines in this process (``HFEngine``) and in their own processes
(``rlferry serve engine`` driven by ``RemoteEngine``), with the same error class and
message in both.
"""

import asyncio
import contextlib
import gc
import logging
import subprocess
import sys

import pytest
import torch

from rlferry.control import (
    Coordinator,
    EngineError,
    GenerateRequest,
    RemoteEngine,
    RequestError,
    SamplingParams,
    WeightUpdateError,
)
from rlferry.weights import WeightSender

transformers = pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
from rlferry.engines.hf import HFEngine  # noqa: E402
from test_control import perturbed, tiny_model  # noqa: E402

# engines in this process, or `rlferry serve engine` processes (slow: a process each)
KINDS = ["local", pytest.param("remote", marks=pytest.mark.slow)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny_model(0).save_pretrained(path)
    return str(path)


class Fleet:
    """Engines of ``tiny_model(0)`` named e0, e1, ..., each joined to one shm sender whose
    buckets are small (several per push); in process or each in its own process."""

    def __init__(self, kind: str, model_dir: str, n: int, group: str) -> None:
        self.kind, self.model_dir, self.group = kind, model_dir, group
        self.sender = WeightSender(group=group, transport="shm", receivers=n, bucket_bytes=4096)
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.engines = [self.start(f"e{i}") for i in range(n)]

    def start(self, name: str):
        if self.kind == "local":
            return HFEngine(tiny_model(0), name=name)
        cmd = [sys.executable, "-m", "rlferry.cli", "serve", "engine", "--model",
               self.model_dir, "--name", name]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("engine http://127.0.0.1:"), line
        self.procs[name] = proc
        return RemoteEngine(line.split()[1], name=name)

    def kill(self, name: str) -> None:
        """The engine dies (SIGKILL across processes; ``close`` in process)."""
        if self.kind == "local":
            next(e for e in self.engines if e.name == name).close()
        else:
            self.procs[name].kill()
            self.procs[name].wait(30)

    async def update(self, coord: Coordinator, source, version: int):
        """``coord.update_weights`` pushing ``source`` (a state dict, or a generator)."""
        items = source.items() if isinstance(source, dict) else source
        return await coord.update_weights(
            lambda t: self.sender.push(items, version=version, timeout=t), version=version,
            timeout=20,
        )  # fmt: skip

    async def join(self, engines) -> None:
        for engine in engines:
            await engine.init_weight_transfer(self.group, self.sender.address)

    async def close(self, coord: Coordinator | None = None) -> None:
        if coord is not None:
            await coord.aclose()
        for engine in self.engines:
            if isinstance(engine, RemoteEngine):
                await engine.aclose()
            else:
                engine.close()
        for proc in self.procs.values():
            proc.terminate()
            proc.wait(30)
        self.sender.close()


@contextlib.asynccontextmanager
async def fleet(kind: str, model_dir: str, n: int = 2, group: str = "faults"):
    f = Fleet(kind, model_dir, n, f"{group}-{kind}")
    try:
        await f.join(f.engines)
        yield f
    finally:
        await f.close()


async def serves(coord: Coordinator, engines: int) -> set[str]:
    """Which engines generate now: a group of many samples, spread over the fleet."""
    group = await asyncio.wait_for(await coord.submit([1, 2, 3], GREEDY, n=4 * engines), 60)
    return {c.engine for c in group.completions}


# -- a failed push ---------------------------------------------------------------------------
def source_that_raises():
    raise RuntimeError("the trainer's gather failed")
    yield  # a generator


@pytest.mark.parametrize("kind", KINDS)
def test_a_push_that_raises_before_reaching_the_engines_leaves_every_engine_serving(
    kind, model_dir
):
    async def main():
        async with fleet(kind, model_dir) as f:
            coord = Coordinator(f.engines, batch_size=8, max_staleness=1)
            with pytest.raises(WeightUpdateError) as e:
                await f.update(coord, source_that_raises(), 1)
            assert str(e.value) == (
                "engine `push`: weight update to version 1 failed at push: `push`: push: "
                "RuntimeError: the trainer's gather failed; 2 engine(s) serve version 0: e0, "
                "e1; the trainer's version stays 0 (retry version 1)"
            )
            assert e.value.stage == "push" and list(e.value.failures) == ["push"]
            assert coord.version == 0 and e.value.version == 0
            for engine in f.engines:
                assert not await engine.is_paused()
                assert await engine.get_weight_version() == 0
            assert coord.statistics().engines_serving == 2
            assert await serves(coord, 2) == {"e0", "e1"}
            # the same version again: the retry works
            state = perturbed(tiny_model(0), 1)
            report = await f.update(coord, state, 1)
            assert report.version == 1 and coord.version == 1
            assert [await x.get_weight_version() for x in f.engines] == [1, 1]
            await coord.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_a_push_of_the_wrong_shape_is_the_pushs_fault_not_the_engines(kind, model_dir):
    async def main():
        async with fleet(kind, model_dir) as f:
            coord = Coordinator(f.engines, batch_size=8, max_staleness=1)
            state = dict(tiny_model(0).state_dict())
            state["lm_head.weight"] = torch.zeros(33, 32)
            with pytest.raises(WeightUpdateError) as e:
                await f.update(coord, state, 1)
            assert list(e.value.failures) == ["push"]
            assert e.value.failures["push"] == (
                "push: every engine refused it: rejected the plan: 1 of 12 tensors differ from "
                "the receiver's parameters: `lm_head.weight`: expected shape [32, 32] float32, "
                "got shape [33, 32] float32"
            )
            assert coord.statistics().engines_serving == 2 and coord.version == 0
            assert await serves(coord, 2) == {"e0", "e1"}
            await coord.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_a_push_that_fails_midway_names_the_push_and_the_next_update_restores_the_fleet(
    kind, model_dir
):
    async def main():
        async with fleet(kind, model_dir) as f:
            coord = Coordinator(f.engines, batch_size=8, max_staleness=1)
            first = perturbed(tiny_model(0), 1)
            await f.update(coord, first, 1)
            second = perturbed(tiny_model(0), 2)

            def midway():  # streams against the first push's layout, then fails
                items = list(second.items())
                yield from items[:6]
                raise RuntimeError("a trainer rank died")

            with pytest.raises(WeightUpdateError) as e:
                await f.update(coord, midway(), 2)
            assert list(e.value.failures) == ["push"]
            assert e.value.failures["push"].startswith("push: RuntimeError: a trainer rank died")
            assert set(e.value.waiting) == {"e0", "e1"}  # they loaded part: not their fault
            assert e.value.version == 1 == coord.version
            assert coord.statistics().engines_serving == 0
            with pytest.raises(TimeoutError) as t:
                await coord.batch(1, timeout=0.2)
            assert "0 of 2 engines serving: `e0`: behind: it holds a mix after the failed push" in (
                str(t.value)
            )
            await f.update(coord, second, 2)
            assert coord.statistics().engines_serving == 2
            assert await serves(coord, 2) == {"e0", "e1"}
            await coord.aclose()

    asyncio.run(main())


# -- a bad request ---------------------------------------------------------------------------
class Unannounced:
    """A real engine that does not announce its limits (as an adapter of a server that
    does not say them): the coordinator cannot check a prompt, the engine refuses it."""

    def __init__(self, engine) -> None:
        self.engine, self.name = engine, engine.name

    def __getattr__(self, attr):
        return getattr(self.engine, attr)

    async def statistics(self):
        import msgspec

        stats = await self.engine.statistics()
        return msgspec.structs.replace(stats, vocab_size=None, max_model_len=None)


BAD_TOKEN = (
    "request `bad`: prompt_ids[1]: expected a token id below 32 (the model's vocab_size), got 40"
)
TOO_LONG = (
    "request `long`: expected prompt + max_tokens <= 128 (the engine's max_model_len), got "
    "3 + 200 = 203 (shorten the prompt or lower max_tokens)"
)


class DiesAtPause(HFEngine):
    """An engine that dies the moment the update pauses it (after the coordinator saw it
    serve): closed, then paused as a closed engine is. (In ``keep`` mode an HFEngine is
    not paused: it loads between its own steps; the tests pause it with ``wait``.)"""

    async def pause(self, mode="keep"):
        self.close()
        return await super().pause(mode)


def test_an_update_whose_every_engine_dies_at_pause_fails_there_without_running_the_push():
    async def main():
        with WeightSender(group="dies", transport="shm", receivers=2) as sender:
            engines = [DiesAtPause(tiny_model(0), name=f"e{i}") for i in range(2)]
            for engine in engines:
                await engine.init_weight_transfer("dies", sender.address)
            coord = Coordinator(engines, batch_size=2, max_staleness=1)
            pushed = []  # a push would wait its whole timeout for receivers that never join
            with pytest.raises(WeightUpdateError) as e:
                await coord.update_weights(pushed.append, version=1, mode="wait", timeout=20)
            await coord.aclose()
            return pushed, e.value, coord.version

    pushed, error, version = asyncio.run(main())
    assert pushed == [] and version == 0
    assert error.stage == "pause" and set(error.failures) == {"e0", "e1"}


@pytest.mark.parametrize("kind", KINDS)
def test_an_engine_refuses_a_bad_request_with_the_same_error_in_process_and_over_http(
    kind, model_dir
):
    async def main():
        async with fleet(kind, model_dir, n=1) as f:
            (engine,) = f.engines
            for rid, prompt, params, want in (
                ("bad", [1, 40, 2], GREEDY, BAD_TOKEN),
                ("long", [1, 2, 3], SamplingParams(max_tokens=200), TOO_LONG),
            ):
                request = GenerateRequest(request_id=rid, prompt_ids=prompt, params=params)
                with pytest.raises(RequestError) as e:
                    await engine.generate(request)
                assert str(e.value) == want and e.value.engine == "e0"
            good = GenerateRequest(request_id="good", prompt_ids=[1, 2, 3], params=GREEDY)
            assert len((await engine.generate(good)).token_ids) == 6

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_the_coordinator_refuses_a_bad_prompt_at_submit_from_the_engines_limits(kind, model_dir):
    async def main():
        async with fleet(kind, model_dir) as f:
            coord = Coordinator(f.engines, batch_size=8, max_staleness=1)
            with pytest.raises(RequestError) as e:
                await coord.submit([1, 40, 2], GREEDY)
            assert str(e.value) == (
                "prompt_ids[1]: expected a token id below 32 (the vocab_size of engine `e0`), "
                "got 40 (nothing was submitted)"
            )
            with pytest.raises(RequestError) as e:
                await coord.submit([1, 2, 3], SamplingParams(max_tokens=126))
            assert str(e.value) == (
                "prompt_ids, max_tokens: expected len(prompt_ids) + max_tokens <= 128 (the "
                "max_model_len of engine `e0`), got 3 + 126 = 129 (shorten the prompt or lower "
                "max_tokens; nothing was submitted)"
            )
            stats = coord.statistics()
            assert stats.running == 0 and stats.capacity == 16 and stats.engines_serving == 2
            assert await serves(coord, 2) == {"e0", "e1"}
            await coord.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_an_engine_refuses_fails_its_group_once_and_the_fleet_serves_on(
    kind, model_dir, caplog
):
    async def main():
        async with fleet(kind, model_dir) as f:
            coord = Coordinator([Unannounced(e) for e in f.engines], batch_size=8)
            with caplog.at_level(logging.WARNING, logger="rlferry.control"):
                bad = await coord.submit([1, 40, 2], GREEDY, n=2, group="bad")
                with pytest.raises(RequestError) as e:
                    await asyncio.wait_for(bad, 30)
            assert str(e.value).startswith("request `r")
            assert str(e.value).endswith(
                ": prompt_ids[1]: expected a token id below 32 (the model's vocab_size), got 40"
            )
            failed = [r for r in caplog.records if r.name == "rlferry.control"]
            assert len(failed) == 1 and failed[0].getMessage().startswith("group 'bad' failed: ")
            stats = coord.statistics()
            assert stats.engines_serving == 2 and stats.failed_groups == 1
            assert await serves(coord, 2) == {"e0", "e1"}
            await coord.aclose()

    asyncio.run(main())


# -- membership ------------------------------------------------------------------------------
def test_an_empty_fleet_is_refused_with_how_to_add_engines():
    with pytest.raises(ValueError) as e:
        Coordinator([], batch_size=4)
    assert str(e.value) == (
        "engines: expected at least one engine, got none (pass HFEngine objects, RemoteEngine "
        "objects or URLs of `rlferry serve engine`; more can join later with add_engine)"
    )


@pytest.mark.parametrize("requests", ["continue", "restart"])
def test_a_removed_engines_requests_go_on_elsewhere_and_updates_no_longer_name_it(requests):
    async def main():
        e0 = HFEngine(tiny_model(0), name="e0")  # the same weights: greedy tokens agree,
        e1 = HFEngine(tiny_model(0), name="e1", version=1)  # the versions tell who made each
        sender = WeightSender(group=f"remove-{requests}", transport="shm", receivers=1)
        await e1.init_weight_transfer(f"remove-{requests}", sender.address)
        coord = Coordinator([e0], batch_size=8, max_staleness=1, version=1)
        try:
            long = SamplingParams(max_tokens=100, temperature=0.0)
            alone = (await asyncio.wait_for(await coord.submit([4, 5], long), 60)).completions
            pending = await coord.submit([4, 5], long)
            clock = await coord.submit([1, 2], SamplingParams(max_tokens=8, temperature=0.0))
            await clock  # 8 decode steps done: the long one is under way on e0
            coord.add_engine(e1)
            await coord.remove_engine("e0", requests=requests)
            (got,) = (await asyncio.wait_for(pending, 60)).completions
            assert got.token_ids == alone[0].token_ids and got.engine == "e1"
            if requests == "continue":  # its tokens from e0 kept, the rest from e1
                assert got.versions[0] == 0 and got.versions[-1] == 1
                assert got.versions == sorted(got.versions)
            else:
                assert got.versions == [1] * 100
            stats = coord.statistics()
            assert stats.engines == 1 and stats.not_serving == {"e0": "removed by remove_engine"}
            state = perturbed(tiny_model(0), 1)
            report = await coord.update_weights(
                lambda t: sender.push(state.items(), version=2, timeout=t), version=2,
                timeout=20,
            )  # fmt: skip
            assert report.engines == ("e1",)
            with pytest.raises(ValueError) as e:
                await coord.remove_engine("e0")
            assert str(e.value) == (
                "remove_engine: expected the name of an engine in the fleet ('e1'), got 'e0'"
            )
        finally:
            await coord.aclose()
            e0.close()
            e1.close()
            sender.close()

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_an_engine_that_dies_mid_generation_is_loud_once_and_its_samples_go_on(
    kind, model_dir, caplog
):
    async def main():
        async with fleet(kind, model_dir) as f:
            coord = Coordinator(f.engines, batch_size=16, max_staleness=1)
            with caplog.at_level(logging.DEBUG):
                # As long as the engines allow (128 tokens), and the kill as early as it can
                # be: e1 must not end its samples before it dies. The clock is a 1-token
                # request to e1 itself: it ends a step or two after e1 took it, however slow
                # e0 is (CI saw e1 end 60-token samples first, then 120-token ones while a
                # clock placed by the coordinator waited on e0, starved of a core)
                long = SamplingParams(max_tokens=120, temperature=0.0)
                pending = [await coord.submit([4, 5], long, n=4, group=k) for k in range(2)]
                clock = GenerateRequest(
                    request_id="clock", prompt_ids=[1, 2], params=SamplingParams(max_tokens=1)
                )
                await asyncio.wait_for(f.engines[1].generate(clock), 60)
                f.kill("e1")
                groups = await asyncio.wait_for(asyncio.gather(*pending), 60)
                assert all(len(c.token_ids) == 120 for g in groups for c in g.completions)
                assert {c.engine for g in groups for c in g.completions} == {"e0"}
                stats = coord.statistics()
                assert stats.engines_serving == 1 and set(stats.not_serving) == {"e1"}
                assert stats.not_serving["e1"].startswith("broken: a request failed: ")
                await coord.aclose()
                gc.collect()
            noisy = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
            assert noisy == []

    asyncio.run(main())


@pytest.mark.slow
def test_a_restarted_engine_is_re_added_and_brought_to_the_fleets_version_before_it_serves(
    model_dir,
):
    async def main():
        async with fleet("remote", model_dir) as f:
            coord = Coordinator(f.engines, batch_size=8, max_staleness=0)
            state = perturbed(tiny_model(0), 1)
            await f.update(coord, state, 1)
            f.kill("e1")
            await serves(coord, 2)  # a request to e1 finds it gone: broken
            assert coord.statistics().not_serving["e1"].startswith("broken: a request failed")
            back = f.start("e1")  # the server restarted: version 0 again
            f.engines.append(back)
            coord.add_engine(back)
            await f.join([back])
            await serves(coord, 1)
            assert coord.statistics().not_serving == {
                "e1": "behind: at version 0, the fleet at 1 (max_staleness 0): it serves once "
                "an update_weights reaches it (join it to the trainer's sender)"
            }
            state = perturbed(tiny_model(0), 2)
            report = await f.update(coord, state, 2)
            assert report.engines == ("e0", "e1")
            assert coord.statistics().engines_serving == 2
            assert await serves(coord, 2) == {"e0", "e1"}
            await coord.aclose()

    asyncio.run(main())


@pytest.mark.slow
def test_a_wait_with_no_engine_serving_says_so_and_why_each_left(model_dir):
    async def main():
        async with fleet("remote", model_dir, n=1) as f:
            coord = Coordinator(f.engines, batch_size=2, engine_timeout=1.0)
            f.kill("e0")
            group = await coord.submit([1, 2], GREEDY, group="g")
            with pytest.raises(TimeoutError) as e:
                await asyncio.wait_for(group, 30)
            assert str(e.value).startswith(
                "an engine that serves: not within 1.0 s (0 of 1 engines serving: `e0`: broken: "
                "statistics() failed: /statistics: unreachable ("
            )
            with pytest.raises(TimeoutError) as e:
                await coord.batch(1, timeout=0.1)
            assert str(e.value).startswith("1 finished groups: not within 0.1 s (0 of 1 engines")
            with pytest.raises(EngineError) as e:
                await coord.update_weights(lambda t: None, version=1)
            assert str(e.value).startswith(
                "engine `coordinator`: update to version 1: no engine to update (0 of 1 engines "
                "serving: `e0`: broken: "
            )
            await coord.aclose()

    asyncio.run(main())


def test_catch_up_brings_a_replacement_to_the_trainers_version_without_a_new_one(model_dir):
    async def main():
        async with fleet("local", model_dir) as f:  # room for the groups of serves(): 32
            coord = Coordinator(f.engines, batch_size=16, max_staleness=0)
            state = perturbed(tiny_model(0), 1)
            await f.update(coord, state, 1)
            f.kill("e1")
            await serves(coord, 2)  # a request to e1 finds it gone: broken
            back = f.start("e1")  # a replacement: the checkpoint's weights, version 0
            f.engines.append(back)
            coord.add_engine(back)
            await f.join([back])
            await serves(coord, 1)
            assert coord.statistics().not_serving["e1"].startswith("behind: at version 0")
            report = await coord.catch_up(
                lambda t: f.sender.push(state.items(), version=1, timeout=t), timeout=20
            )  # fmt: skip
            assert report.version == 1 and report.engines == ("e0", "e1")
            stats = coord.statistics()
            assert (stats.version, stats.engines_serving, stats.updates) == (1, 2, 1)
            assert await back.get_weight_version() == 1
            assert await back.fingerprint() == await f.engines[0].fingerprint()
            assert await serves(coord, 2) == {"e0", "e1"}
            await coord.aclose()

    asyncio.run(main())


def test_catch_up_with_no_engine_to_update_says_so():
    async def main():
        engine = HFEngine(tiny_model(0), name="e0")
        coord = Coordinator([engine], batch_size=2)
        engine.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(await coord.submit([1, 2], GREEDY), 2)
        with pytest.raises(EngineError) as e:
            await coord.catch_up(lambda t: None)
        assert str(e.value).startswith(
            "engine `coordinator`: catch_up to version 0: no engine to update (0 of 1 engines "
            "serving: `e0`: broken: "
        )
        await coord.aclose()

    asyncio.run(main())
