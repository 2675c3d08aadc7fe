"""The coordinator against real engines: staleness, weight updates, failures, restarts."""

import asyncio
import random

import pytest
import torch

from rlferry.control import Coordinator, EngineError, SamplingParams
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


async def close_all(coord, engines, sender):
    await coord.close()
    for engine in engines:
        engine.close()
    sender.close()


@pytest.mark.parametrize(("eta", "stale"), [(0, "drop"), (1, "regenerate"), (2, "drop")])
def test_no_consumed_sample_lags_more_than_max_staleness(eta, stale):
    async def main():
        trainer, engines, sender = await engines_with_sender(2)
        rng = random.Random(eta)
        coord = Coordinator(engines, batch_size=4, max_staleness=eta, stale=stale)

        async def produce():
            k = 0
            while True:  # long and short rollouts, so updates land while some are running
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 6))]
                params = SamplingParams(max_tokens=rng.randrange(4, 60), temperature=1.0)
                await coord.submit(prompt, params, n=2, group=k)
                k += 1

        producer = asyncio.ensure_future(produce())
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
                state = perturbed(trainer, step)
                await coord.update_weights(
                    lambda t, s=state, v=step: sender.push(s.items(), version=v, timeout=t),
                    version=step, mode=rng.choice(["keep", "abort", "wait"]), timeout=60,
                )  # fmt: skip
        finally:
            producer.cancel()
            await close_all(coord, engines, sender)
        assert lags and max(lags) <= eta
        stats = coord.statistics()
        assert stats.staleness_max <= eta and stats.consumed == 5 * 4
        if eta > 0:  # some rollout ran across an update (trained, or dropped as too stale)
            assert spanned or stats.dropped
        if eta == 0:  # synchronous: nothing generates during an update, no token is stale
            assert set(lags) == {0} and not spanned

    run(main())
