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
