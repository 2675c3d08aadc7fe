"""`rlferry demo --launcher ray`: the same job with every process a Ray actor."""

import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need the [ray] extra")
pytest.importorskip("transformers", reason="needs transformers (the [demo] extra)")

from rlferry.rl.demo import DemoConfig, run_demo  # noqa: E402


def test_a_short_demo_on_ray_ends_with_the_trainers_weights_and_leaves_no_actor(ray_cluster):
    config = DemoConfig(steps=3, engines=2, max_staleness=1, groups_per_step=2, group_size=4,
                        warm_steps=2, launcher="ray")  # fmt: skip
    run = run_demo(config)  # on the Ray this process is connected to: left running after
    assert [s.step for s in run.steps] == [1, 2, 3]
    assert all(s.samples == 8 and max(s.lags) <= 1 for s in run.steps)
    # the run checked that the engine actors hold the trainer actors' weights bit for bit
    assert run.summary["engine_versions"] == [3, 3]
    assert len(run.summary["weights_fingerprint"]) == 64
    assert ray.is_initialized()
    named = ray.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if a["name"].startswith("rlferry/demo-")]


def test_a_ray_address_without_the_ray_launcher_is_refused():
    with pytest.raises(ValueError) as e:
        DemoConfig(ray_address="10.0.0.1:6379")
    assert str(e.value) == "ray_address: given without --launcher ray (add it, or drop it)"
