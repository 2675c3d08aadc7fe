"""Engines as Ray actors on a real local cluster (fake GPUs): placement in GPU order, driven
by the coordinator over HTTP, deaths mid-generation and mid-update named with Ray's reason."""

import asyncio

import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need the [ray] extra")
transformers = pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")

from rlferry.control import Coordinator, EngineError, GenerateRequest, SamplingParams  # noqa: E402
from rlferry.ray import LaunchError, RayEngines  # noqa: E402
from test_control import tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run

KILLED = "The actor is dead because it was killed by `ray.kill`."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny_model(0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engines(ray_cluster, model_dir):
    with RayEngines.start("eng", model_dir, engines=2, gpus_per_engine=1, cpus_per_engine=0.5,
                          options={"device": "cpu"}) as e:  # fmt: skip
        yield e


def _kill(actor):
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.until_closed.remote(), timeout=30)


def test_engine_i_gets_the_ith_bundle_in_node_and_gpu_order(engines):
    places = engines.places
    assert places == sorted(places, key=lambda p: (p["ip"], p["gpus"][:1], p["node"]))
    assert [len(p["gpus"]) for p in places] == [1, 1]
    assert len({(p["node"], p["gpus"][0]) for p in places}) == 2  # each its own GPU
    for name, place in zip(engines.names, places, strict=True):  # Ray's GPU, as the engine sees
        seen = ray.get(engines.actors[name].where.remote(), timeout=30)
        assert seen == place
        assert seen["visible"] == str(seen["gpus"][0])  # the actor sees its GPU alone
    assert engines.names == ["rlferry/eng/engine0", "rlferry/eng/engine1"]


def test_the_coordinator_drives_ray_engines_over_http(engines):
    async def main():
        coord = Coordinator(engines.engines, batch_size=4, max_staleness=1)
        try:
            await coord.submit([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0), n=4)
            (group,) = await coord.batch(1, timeout=60)
        finally:
            await coord.close()
            for e in engines.engines:
                await e.close()
        return group

    group = asyncio.run(main())
    assert [len(c.token_ids) for c in group.completions] == [4, 4, 4, 4]
    assert {c.engine for c in group.completions} <= {"engine0", "engine1"}


def test_the_job_name_of_running_engines_is_refused(engines, model_dir):
    ns = ray.get_runtime_context().namespace
    with pytest.raises(LaunchError) as e:
        RayEngines.start("eng", model_dir)
    assert str(e.value) == (
        f"job `eng`: its engines are already running in Ray namespace `{ns}` (actor "
        "`rlferry/eng/engine0`): close them, or start these under another job name"
    )


def test_an_infeasible_engine_group_fails_naming_the_bundles(ray_cluster, model_dir):
    with pytest.raises(LaunchError) as e:
        RayEngines.start("huge", model_dir, engines=3, gpus_per_engine=2, ready_timeout=1)
    assert str(e.value).startswith(
        "job `huge`: engines: Ray could not place 3 bundles [{CPU: 1, GPU: 2}, {CPU: 1, GPU: 2}, "
        "{CPU: 1, GPU: 2}] (PACK) within 1 s; free per node: "
    )


def test_an_engine_killed_with_a_generate_waiting_and_mid_update_fails_calls_naming_it(
    ray_cluster, model_dir
):
    async def main(started):
        gen_engine, update_engine = started.engines
        await gen_engine.pause("keep")  # the generate below waits in the engine, for sure
        request = GenerateRequest(request_id="r", prompt_ids=[1, 2, 3], params=SamplingParams())
        generating = asyncio.ensure_future(gen_engine.generate(request))
        await update_engine.start_weight_update()
        await asyncio.to_thread(_kill, started.actors["rlferry/kills/engine0"])
        await asyncio.to_thread(_kill, started.actors["rlferry/kills/engine1"])
        errors = []
        for call in (generating, update_engine.finish_weight_update(1)):
            with pytest.raises(EngineError) as e:
                await asyncio.wait_for(call, 10)
            errors.append(str(e.value))
        for e in started.engines:
            await e.close()
        return errors

    with RayEngines.start("kills", model_dir, engines=2, cpus_per_engine=0.5,
                          options={"device": "cpu"}) as started:  # fmt: skip
        errors = asyncio.run(main(started))
    assert errors == [
        f"engine `engine0`: actor `rlferry/kills/engine0` died: {KILLED}",
        f"engine `engine1`: actor `rlferry/kills/engine1` died: {KILLED}",
    ]


def test_a_restarted_engine_actor_rejoins_and_is_updated_before_it_serves(ray_cluster, model_dir):
    from rlferry.weights import WeightSender

    async def main(started):
        sender = WeightSender(group="g", transport="shm", receivers=1)
        trained = tiny_model(1).state_dict()  # "trained" weights: another seed
        (engine,) = started.engines
        await engine.init_weight_transfer("g", sender.address)
        coord = Coordinator(started.engines, batch_size=2, max_staleness=1)

        def push(version):
            return lambda t: sender.push(trained.items(), version=version, timeout=t)

        try:
            await coord.update_weights(push(1), version=1)
            actor = started.actors["rlferry/restart/engine0"]
            ray.kill(actor, no_restart=False)  # Ray restarts it: the checkpoint's weights
            await engine.ended(30)
            with pytest.raises(EngineError) as e:
                await asyncio.wait_for(engine.get_weight_version(), 30)
            new = await started.rejoin(0, coord, weights=("g", sender.address))
            assert new.url != engine.url and await new.get_weight_version() == 0
            await coord.update_weights(push(2), version=2)  # brings it to the version
            await coord.submit([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0), n=2)
            (group,) = await coord.batch(1, timeout=60)
            return e.value, await new.get_weight_version(), group
        finally:
            await coord.close()
            sender.close()
            for e in started.engines:
                await e.close()

    with RayEngines.start("restart", model_dir, engines=1, cpus_per_engine=0.5, max_restarts=1,
                          options={"device": "cpu"}) as started:  # fmt: skip
        error, version, group = asyncio.run(main(started))
    assert error.gone
    assert str(error).startswith("engine `engine0`: actor `rlferry/restart/engine0` died: ")
    assert version == 2
    assert all(c.versions == [2, 2, 2] for c in group.completions)


def test_weights_reach_engine_actors_by_broadcast_through_the_launchers_rendezvous(engines):
    from rlferry.ray import weight_sender
    from rlferry.weights import fingerprint

    trained = tiny_model(2).state_dict()

    async def main():
        sender = weight_sender("eng", group="bcast", receivers=2)  # gloo: CPU tensors
        coord = Coordinator(engines.engines, batch_size=2, max_staleness=1)
        try:
            for e in engines.engines:
                await e.init_weight_transfer("bcast", sender.address)
            push = lambda t: sender.push(trained.items(), version=1, timeout=t)  # noqa: E731
            await coord.update_weights(push, version=1)
            return sender.address, [(await e.get_weight_version(), await e.fingerprint())
                                    for e in engines.engines]  # fmt: skip
        finally:
            await coord.close()
            sender.close()
            for e in engines.engines:
                await e.close()

    address, served = asyncio.run(main())
    assert address.startswith(f"tcp://{ray.util.get_node_ip_address()}:")  # off loopback
    assert served == [(1, fingerprint(trained.items()))] * 2


def test_engines_in_a_callers_gpu_bundle_share_its_gpu_and_leave_its_group(ray_cluster, model_dir):
    from rlferry.ray import place

    def where():  # defined here: Ray ships it by value
        import os

        gpus = sorted(int(g) for g in ray.get_gpu_ids())
        node = ray.get_runtime_context().get_node_id()
        return {"node": node, "gpus": gpus, "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    pg = place([{"GPU": 1, "CPU": 1}], "STRICT_PACK", name="rlferry/shared/gpus",
               what="a trainer's GPU", ready_timeout=30)  # fmt: skip
    try:
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(pg, 0)
        with RayEngines.start("shared", model_dir, engines=2, gpus_per_engine=1 / 3,
                              cpus_per_engine=0.25, options={"device": "cpu"},
                              bundle=(pg, 0)) as e:  # fmt: skip
            rank = ray.remote(where)
            one = rank.options(num_gpus=1 / 3, num_cpus=0.25, scheduling_strategy=strategy)
            beside = ray.get(one.remote(), timeout=60)
            assert len(beside["gpus"]) == 1
            assert [(p["node"], p["gpus"], p["visible"]) for p in e.places] == 2 * [
                (beside["node"], beside["gpus"], beside["visible"])
            ]
        assert ray.util.placement_group_table(pg)["state"] == "CREATED"  # the caller's still
    finally:
        ray.util.remove_placement_group(pg)


def test_a_gpu_share_that_is_neither_a_fraction_nor_whole_is_refused(ray_cluster, model_dir):
    with pytest.raises(ValueError) as e:
        RayEngines.start("badshare", model_dir, gpus_per_engine=1.5)
    assert str(e.value) == (
        "gpus_per_engine: expected 0, a fraction of one GPU or a whole number, got 1.5"
    )


def test_a_runtime_env_that_is_not_a_dict_is_refused_before_anything_starts(ray_cluster, model_dir):
    with pytest.raises(ValueError) as e:
        RayEngines.start("badenv", model_dir, runtime_env="VLLM_CPU_KVCACHE_SPACE=1")
    assert str(e.value) == (
        "runtime_env: expected a dict of Ray's runtime environment (e.g. {'env_vars': {...}}) "
        "or None, got str"
    )
