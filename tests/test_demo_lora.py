"""`rlferry demo --lora RANK`: the trainer ranks train an adapter on the frozen base and push it
alone; the engines end serving the trainer's base + adapter, bit for bit."""

import pytest

pytest.importorskip("transformers", reason="needs transformers (the [demo] extra)")
pytest.importorskip("matplotlib", reason="needs matplotlib (the [demo] extra)")

from rlferry.rl.demo import DemoConfig, run_demo
from rlferry.rl.model import make_model
from rlferry.rl.task import ReverseTask

pytestmark = pytest.mark.slow  # a run of the demo: processes, a few seconds


def test_a_short_lora_demo_pushes_only_the_adapter_and_ends_with_the_trainers():
    config = DemoConfig(
        steps=3, engines=2, max_staleness=1, groups_per_step=2, group_size=4, warm_steps=5,
        lora=4,
    )  # fmt: skip
    run = run_demo(config)
    assert run.summary["engine_versions"] == [3, 3]
    # the run checked the engines' base + adapter against the trainer's: a mismatch raises
    assert len(run.summary["weights_fingerprint"]) == 64
    # rank 0 pushes A [4, in] and B [out, 4] of every attention and MLP linear (float32 on
    # the CPU) and the adapter's config (3 float32); the other rank pushes nothing
    model = make_model(config.model, ReverseTask().tokenizer.vocab_size, seed=0)
    adapter = sum(
        4 * (m.in_features + m.out_features) * 4
        for n, m in model.named_modules()
        if n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj")
    )  # fmt: skip
    assert run.summary["weights_bytes_per_rank"] == [adapter + 12, 0]
    assert run.summary["LoRA: bytes pushed per update"] == adapter + 12
    assert "LoRA rank 4" in run.name


def test_lora_demo_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match=r"lora: expected None or an int >= 1 \(a rank\), got 0"):
        DemoConfig(lora=0)
    with pytest.raises(ValueError, match=r"lora: the demo serves adapters with --engine hf"):
        DemoConfig(lora=4, engine="vllm")
