"""HFEngine on CUDA: the slot cache with decode steps replayed as CUDA graphs.

Skipped without a GPU (CUDA graphs need one); ``HFEngine(kv_cache="slots")`` runs the
same code without graphs on the CPU in test_engine_hf.py.
"""

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlferry.control import GenerateRequest, SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs of the decode step)"
)
transformers = pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
from rlferry.engines.hf import HFEngine  # noqa: E402
from test_engine_hf import PROMPTS, reference, tiny_model  # noqa: E402


def greedy(rid, prompt, n):
    params = SamplingParams(max_tokens=n, temperature=0.0)
    return GenerateRequest(request_id=rid, prompt_ids=prompt, params=params)


def test_graph_replayed_greedy_tokens_equal_model_generate_and_rows_join_and_leave():
    model = tiny_model(0).cuda()

    async def main():
        with HFEngine(model, name="g", max_batch=8) as engine:
            assert engine.kv_cache == "slots"
            first = await asyncio.gather(
                *(engine.generate(greedy(k, p, 24)) for k, p in PROMPTS.items())
            )
            # one joins a running batch, others end early: slots move, graphs are replayed
            long = asyncio.ensure_future(engine.generate(greedy("long", PROMPTS["c"], 40)))
            short = [engine.generate(greedy(f"s{i}", PROMPTS["a"], 3 + i)) for i in range(4)]
            later = await asyncio.gather(*short)
            return first, later, await long

    first, later, long = asyncio.run(main())
    for c, p in zip(first, PROMPTS.values(), strict=True):
        tokens, logp = reference(model, p, 24)
        assert c.token_ids == tokens
        assert c.logprobs == pytest.approx(logp, abs=1e-4)
    for i, c in enumerate(later):
        assert c.token_ids == reference(model, PROMPTS["a"], 3 + i)[0]
    assert long.token_ids == reference(model, PROMPTS["c"], 40)[0]


def test_graphs_read_weights_loaded_in_place():
    from rlferry.weights import WeightSender

    model, trainer = tiny_model(0).cuda(), tiny_model(1)  # the trainer pushes from the CPU
    want_before = reference(model, PROMPTS["a"], 16)[0]  # the engine loads into ``model``

    async def main():
        with HFEngine(model, name="g", max_batch=4) as engine:
            sender = WeightSender(group="gpu-graphs", transport="shm")
            await engine.init_weight_transfer("gpu-graphs", sender.address)
            before = await engine.generate(greedy("a", PROMPTS["a"], 16))
            await engine.pause("keep")
            await engine.start_weight_update()
            await asyncio.to_thread(sender.push, trainer.state_dict().items(), version=1)
            await engine.finish_weight_update(1)
            await engine.resume()
            after = await engine.generate(greedy("b", PROMPTS["a"], 16))
            sender.close()
            return before, after

    before, after = asyncio.run(main())
    assert before.token_ids == want_before
    assert after.token_ids == reference(trainer.cuda(), PROMPTS["a"], 16)[0]
    assert after.versions == [1] * 16


def test_an_engine_on_the_second_gpu_captures_its_graphs_there():
    """In a process of its own, as ``rlferry serve engine`` and the demo run engines (two
    engines on two GPUs in one process: README, Limits)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    code = textwrap.dedent("""
        import asyncio, torch
        from rlferry.engines.hf import HFEngine
        from test_engine_gpu import greedy
        from test_engine_hf import PROMPTS, reference, tiny_model
        model = tiny_model(0).to("cuda:1")  # the current device stays cuda:0
        async def main():
            with HFEngine(model, name="g1", max_batch=4) as engine:
                return await engine.generate(greedy("a", PROMPTS["a"], 12))
        out = asyncio.run(main())
        assert torch.cuda.current_device() == 0
        assert out.token_ids == reference(model, PROMPTS["a"], 12)[0], out.token_ids
        print("same tokens")
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100, env=env)  # fmt: skip
    assert done.returncode == 0 and "same tokens" in done.stdout, done.stderr[-3000:]
