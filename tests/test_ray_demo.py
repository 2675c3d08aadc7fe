"""`rlferry demo --launcher ray`: the same job with every process a Ray actor."""

import subprocess
import sys

import pytest

from conftest import requires_cuda

ray = pytest.importorskip("ray", reason="the Ray tests need the [ray] extra")
pytest.importorskip("transformers", reason="needs transformers (the [demo] extra)")

from rlferry.rl.demo import DemoConfig, run_demo  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run


def test_a_short_demo_on_ray_ends_with_the_trainers_weights_and_leaves_no_actor(ray_cluster):
    config = DemoConfig(steps=3, engines=2, max_staleness=1, groups_per_step=2, group_size=4,
                        warm_steps=2, launcher="ray")  # fmt: skip
    run = run_demo(config)  # on the Ray this process is connected to: left running after
    assert [s.step for s in run.steps] == [1, 2, 3]
    assert all(s.samples == 8 and max(s.lags) <= 1 for s in run.steps)
    # the run checked that the engine actors hold the trainer actors' weights bit for bit
    assert run.summary["engine_versions"] == [3, 3]
    assert len(run.summary["weights_fingerprint"]) == 64
    sent = run.summary["weights_bytes_per_rank"]  # each trainer actor pushed its own shards
    assert len(sent) == 2 and min(sent) > 0
    assert ray.is_initialized()
    named = ray.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if a["name"].startswith("rlferry/demo-")]


def test_a_ray_address_without_the_ray_launcher_is_refused():
    with pytest.raises(ValueError) as e:
        DemoConfig(ray_address="10.0.0.1:6379")
    assert str(e.value) == "ray_address: given without --launcher ray (add it, or drop it)"


def test_the_split_layout_on_ray_is_refused_naming_the_one_that_runs():
    with pytest.raises(ValueError) as e:
        DemoConfig(launcher="ray", layout="split")
    assert str(e.value) == (
        "layout: 'split' runs with the local launcher only (on Ray the demo runs colocated: "
        "the engines share trainer rank 0's GPU bundle): use --layout colocated, or "
        "--launcher local"
    )


@requires_cuda
def test_a_short_demo_on_ray_on_a_gpu_pushes_by_cuda_ipc_to_engine_actors(tmp_path):
    # its own Ray (a process of its own: the session's cluster has fake GPUs)
    script = (
        "from rlferry.rl.demo import DemoConfig, run_demo\n"
        "c = DemoConfig(steps=3, engines=2, max_staleness=1, groups_per_step=2, group_size=4,\n"
        "               warm_steps=2, launcher='ray', device='cuda')\n"
        "r = run_demo(c)\n"
        "assert [s.step for s in r.steps] == [1, 2, 3], r.steps\n"
        "assert r.summary['engine_versions'] == [3, 3], r.summary\n"
        "print('ok', r.summary['weights_fingerprint'])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.splitlines()[-1].startswith("ok ")


def test_an_engine_actor_killed_mid_run_restarts_rejoins_and_serves_the_last_version(
    ray_cluster, monkeypatch
):
    import asyncio
    import os
    import signal
    import threading

    import rlferry.rl.demo as demo
    from rlferry.control import Coordinator

    taken: list[list[int]] = []

    class Recording(Coordinator):
        async def batch(self, groups, **kw):
            out = await super().batch(groups, **kw)
            taken.append([g.group for g in out])
            if self.statistics().engines_serving < 2:  # while engine0 restarts: slower
                await asyncio.sleep(0.2)
            return out

    monkeypatch.setattr(demo, "Coordinator", Recording)
    killed: list[int] = []

    def kill_engine0() -> None:  # its actor's worker process, as the OOM killer would
        [name] = [
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("rlferry/demo-") and a["name"].endswith("/engine0")
        ]
        actor = ray.get_actor(name["name"], namespace=name["namespace"])
        killed.append(ray.get(actor.where.remote(), timeout=60)["pid"])
        os.kill(killed[-1], signal.SIGKILL)

    threads: list[threading.Thread] = []

    def progress(row):  # off the run's loop: Ray's calls block
        if row.step == 2:
            threads.append(threading.Thread(target=kill_engine0))
            threads[-1].start()

    config = DemoConfig(steps=150, engines=2, max_staleness=1, groups_per_step=2, group_size=4,
                        warm_steps=2, launcher="ray")  # fmt: skip
    run = run_demo(config, progress)
    threads[0].join()
    assert [s.step for s in run.steps] == list(range(1, 151))
    assert all(s.samples == 8 and max(s.lags) <= 1 for s in run.steps)
    groups = [k for step in taken for k in step]
    assert len(groups) == 300 and len(set(groups)) == 300  # no group trained twice
    [loss] = run.summary["engine_losses"]
    assert loss["engine"] == "engine0" and loss["failed"] is None
    assert loss["why"].startswith("actor `rlferry/demo-") and "/engine0` died: " in loss["why"]
    assert 2 <= loss["step"] <= loss["rejoined_step"] < 150
    # Ray restarted the actor; it joined the trainer actors' senders and got every update
    assert run.summary["engine_versions"] == [150, 150]
    assert len(run.summary["weights_fingerprint"]) == 64
