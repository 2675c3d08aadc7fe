"""HFEngine: batched decoding, sampling, pause modes, aborts, input errors and end of life.

A tiny random-init Llama made in the test; no timing assertions (a pause is measured
in decode steps). Weight updates are in test_engine_hf_weights.py.
"""

import asyncio

import pytest
import torch

from rlferry import errors
from rlferry.control import Engine, EngineClosed, EngineError, GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
from rlferry.engines.hf import HFEngine  # noqa: E402

# The engine calls no deprecated transformers API (its deprecations are FutureWarnings).
pytestmark = pytest.mark.filterwarnings("error:.*deprecated.*:FutureWarning")
VOCAB = 64


@pytest.fixture(params=["dynamic", "slots"])
def kv(request):
    """Both KV caches: the dynamic one (the CPU's default) and the slots (CUDA's)."""
    return {"kv_cache": request.param}


def tiny_model(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def req(rid, prompt, **params):
    params.setdefault("temperature", 0.0)
    return GenerateRequest(request_id=rid, prompt_ids=prompt, params=SamplingParams(**params))


PROMPTS = {"a": [1, 2, 3, 4, 5], "b": [7, 8, 9], "c": [10, 11, 12, 13, 14, 15, 16, 17]}


def reference(model, prompt, n):
    """``model.generate`` greedy, alone (no padding): tokens and their log-softmax."""
    device = next(model.parameters()).device
    out = model.generate(
        torch.tensor([prompt], device=device), max_new_tokens=n, min_new_tokens=n, do_sample=False,
        pad_token_id=0, eos_token_id=None, output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    scores = [torch.log_softmax(s[0].float().cpu(), -1) for s in out.scores]
    logp = [s[t].item() for s, t in zip(scores, tokens, strict=True)]
    return tokens, logp


def teacher_forced_logp(model, prompt, tokens, temperature):
    """log softmax(logits / T) of each generated token, from one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
    return logp, logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


async def steps(engine):
    return (await engine.statistics()).steps


# -- decoding ----------------------------------------------------------------------------------


def test_the_engine_is_an_rlferry_engine(model):
    with HFEngine(model, name="e") as engine:
        assert isinstance(engine, Engine)
        assert engine.name == "e" and engine.device == torch.device("cpu")


def test_batched_greedy_tokens_equal_model_generate_for_each_prompt(model, kv):
    """Three prompts of three lengths decode in one batch (left padded, one prefill);
    each row's tokens and logprobs are model.generate's for that prompt alone."""

    async def main():
        with HFEngine(model, name="e", **kv) as engine:
            done = await asyncio.gather(
                *(engine.generate(req(k, p, max_tokens=24)) for k, p in PROMPTS.items())
            )
            return done, await engine.statistics()

    done, stats = asyncio.run(main())
    for c, (k, p) in zip(done, PROMPTS.items(), strict=True):
        tokens, logp = reference(model, p, 24)
        assert (c.request_id, c.prompt_ids, c.finish_reason, c.engine) == (k, p, "length", "e")
        assert c.token_ids == tokens
        assert c.logprobs == pytest.approx(logp, abs=1e-5)
        assert c.versions == [0] * 24
    assert stats.steps == 24  # one prefill for all three, then 23 decode steps
    assert (stats.tokens, stats.finished, stats.running, stats.waiting) == (72, 3, 0, 0)


def test_a_sliding_window_model_decodes_as_model_generate():
    """Mistral attends through a window of 4 tokens: the engine keeps transformers'
    sliding masks (prompts and answers longer than the window, padded in one batch)."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, sliding_window=4,
    )  # fmt: skip
    mistral = transformers.MistralForCausalLM(config).eval()

    async def main():
        with HFEngine(mistral) as engine:
            return await asyncio.gather(
                *(engine.generate(req(k, p, max_tokens=16)) for k, p in PROMPTS.items())
            )

    for done, prompt in zip(asyncio.run(main()), PROMPTS.values(), strict=True):
        assert done.token_ids == reference(mistral, prompt, 16)[0]


def test_a_request_that_joins_a_running_batch_decodes_as_it_would_alone(model, kv):
    async def main():
        with HFEngine(model, **kv) as engine:
            first = asyncio.ensure_future(engine.generate(req("a", PROMPTS["a"], max_tokens=30)))
            await engine.generate(req("clock", [3], max_tokens=3))  # "a" is mid-run now
            late = await engine.generate(req("c", PROMPTS["c"], max_tokens=20))
            return await first, late

    first, late = asyncio.run(main())
    assert first.token_ids == reference(model, PROMPTS["a"], 30)[0]
    assert late.token_ids == reference(model, PROMPTS["c"], 20)[0]


def test_a_stop_token_ends_the_request_and_is_kept(model, kv):
    tokens = reference(model, PROMPTS["b"], 24)[0]
    stop = tokens[5]
    k = tokens.index(stop)

    async def main():
        with HFEngine(model, **kv) as engine:
            return await engine.generate(
                req("b", PROMPTS["b"], max_tokens=24, stop_token_ids=(stop,))
            )

    done = asyncio.run(main())
    assert (done.token_ids, done.finish_reason) == (tokens[: k + 1], "stop")


def test_a_seeded_request_samples_the_same_tokens_alone_or_in_a_batch(model, kv):
    params = {"max_tokens": 20, "temperature": 0.8, "seed": 7}

    async def main():
        with HFEngine(model, **kv) as engine:
            alone = await engine.generate(req("s", PROMPTS["a"], **params))
            batched = await asyncio.gather(
                engine.generate(req("s", PROMPTS["a"], **params)),
                engine.generate(req("x", PROMPTS["c"], max_tokens=20, temperature=1.0)),
                engine.generate(req("g", PROMPTS["b"], max_tokens=9)),  # greedy beside
            )
            other_seed = await engine.generate(req("s", PROMPTS["a"], **{**params, "seed": 8}))
            return alone, batched[0], other_seed

    alone, batched, other_seed = asyncio.run(main())
    assert alone.token_ids == batched.token_ids
    assert alone.token_ids != other_seed.token_ids
    # Each logprob is log softmax(logits / T) at the sampled token.
    _, logp = teacher_forced_logp(model, PROMPTS["a"], alone.token_ids, 0.8)
    assert alone.logprobs == pytest.approx(logp, abs=1e-4)


def test_rows_of_one_prompt_share_its_prefill_and_decode_as_each_would_alone(model, kv):
    """A GRPO group: eight rows of one prompt (four greedy, four sampled with their own
    seeds) beside two other prompts, admitted in one prefill; with slots the prompt runs
    once and its keys and values are copied to the other rows' slots. Each row's tokens
    and logprobs are what it gets alone; the rows' slots move as rows end at their own
    lengths (a stop token)."""
    a = PROMPTS["a"]
    greedy, _ = reference(model, a, 12)
    stop = greedy[5]  # the greedy rows end at their sixth token

    def group():
        return [req(f"g{i}", a, max_tokens=12, stop_token_ids=(stop,)) for i in range(4)] + [
            req(f"s{i}", a, max_tokens=12, temperature=0.9, seed=i) for i in range(4)
        ]

    async def main():
        with HFEngine(model, **kv) as engine:
            alone = [await engine.generate(r) for r in group()]
            before = await steps(engine)
            together = await asyncio.gather(
                *(engine.generate(r) for r in group()),
                engine.generate(req("b", PROMPTS["b"], max_tokens=12)),
                engine.generate(req("c", PROMPTS["c"], max_tokens=12)),
            )
            return alone, together, await steps(engine) - before

    alone, together, taken = asyncio.run(main())
    assert taken == 12  # one prefill for the ten rows, then 11 decode steps
    for one, many in zip(alone, together, strict=False):
        assert many.token_ids == one.token_ids
        assert many.logprobs == pytest.approx(one.logprobs, abs=1e-5)
    assert [c.token_ids for c in together[:4]] == [greedy[:6]] * 4
    assert len({tuple(c.token_ids) for c in together[4:8]}) > 1  # seeds of their own
    assert together[8].token_ids == reference(model, PROMPTS["b"], 12)[0]
    assert together[9].token_ids == reference(model, PROMPTS["c"], 12)[0]


def test_rows_that_move_into_freed_slots_keep_every_column_they_hold(model, kv):
    """Short rows end first and the long rows after them move into their slots (with slots:
    a mover's columns are copied up to its length, not the slot's whole length): each
    long row's tokens are what it generates alone."""
    long_prompt = list(range(20, 44))  # 24 tokens: past the short rows' columns
    short = [req(f"s{i}", PROMPTS["b"], max_tokens=2) for i in range(3)]
    long = [req("c", PROMPTS["c"], max_tokens=16), req("l", long_prompt, max_tokens=16)]

    async def main():
        with HFEngine(model, max_model_len=64, **kv) as engine:
            return await asyncio.gather(*(engine.generate(r) for r in short + long))

    done = asyncio.run(main())
    assert [len(c.token_ids) for c in done] == [2, 2, 2, 16, 16]
    assert done[3].token_ids == reference(model, PROMPTS["c"], 16)[0]
    assert done[4].token_ids == reference(model, long_prompt, 16)[0]


def test_a_prefills_token_budget_counts_the_prompts_its_rows_share(model):
    """With slots a prefill runs each distinct prompt once, so its ``max_prefill_tokens``
    counts prompts, not rows: eight rows of one prompt join in one prefill of 16 tokens
    (one padded row), where a row each would take eight."""

    async def main():
        with HFEngine(model, kv_cache="slots", max_prefill_tokens=16) as engine:
            done = await asyncio.gather(
                *(engine.generate(req(f"r{i}", PROMPTS["a"], max_tokens=4)) for i in range(8))
            )
            return done, await steps(engine)

    done, taken = asyncio.run(main())
    assert taken == 4  # one prefill, three decode steps
    assert {tuple(c.token_ids) for c in done} == {tuple(reference(model, PROMPTS["a"], 4)[0])}


def test_top_p_samples_only_from_the_nucleus(model, kv):
    async def main():
        with HFEngine(model, **kv) as engine:
            return await asyncio.gather(*(
                engine.generate(req(f"r{i}", PROMPTS["c"], max_tokens=30, temperature=1.5,
                                    top_p=0.3, seed=i))
                for i in range(4)
            ))  # fmt: skip

    for done in asyncio.run(main()):
        logp, _ = teacher_forced_logp(model, PROMPTS["c"], done.token_ids, 1.5)
        for row, token in zip(logp.exp(), done.token_ids, strict=True):
            sorted_p, order = row.sort(descending=True)
            nucleus = int(((sorted_p.cumsum(0) - sorted_p) < 0.3).sum())
            assert token in order[:nucleus].tolist()


# -- pause, resume, abort -----------------------------------------------------------------------


async def long_and_clock(engine, long=40):
    """Start "long" beside a 4-token "clock"; return once the clock ended (so "long" is
    mid-run, 4 steps in) with the task of "long"."""
    task = asyncio.ensure_future(engine.generate(req("long", PROMPTS["c"], max_tokens=long)))
    await engine.generate(req("clock", PROMPTS["b"], max_tokens=4))
    return task


def test_keep_mode_pauses_within_one_step_and_resumes_to_the_uninterrupted_tokens(model, kv):
    async def main():
        with HFEngine(model, **kv) as engine:
            uninterrupted = await (await long_and_clock(engine))
            task = await long_and_clock(engine)
            before = await steps(engine)
            await engine.pause("keep")
            paused_at = await engine.statistics()
            assert paused_at.steps - before <= 1  # the step in progress, at most
            assert await engine.is_paused() and paused_at.paused and paused_at.running == 1
            assert await engine.abort_requests(["nobody"]) == 0  # a round trip of its thread
            assert await steps(engine) == paused_at.steps and not task.done()
            await engine.resume()
            assert not await engine.is_paused()
            return uninterrupted, await task

    uninterrupted, resumed = asyncio.run(main())
    assert resumed.token_ids == uninterrupted.token_ids
    assert resumed.logprobs == uninterrupted.logprobs  # the same computation, bit for bit
    assert resumed.finish_reason == "length"


def test_abort_mode_returns_partial_tokens_that_a_continuation_completes(model, kv):
    async def main():
        with HFEngine(model, **kv) as engine:
            full = await engine.generate(req("full", PROMPTS["c"], max_tokens=40))
            task = await long_and_clock(engine)
            before = await steps(engine)
            await engine.pause("abort")
            assert await steps(engine) - before <= 1
            partial = await task  # returned by the pause, not by a resume
            assert (await engine.statistics()).aborted == 1
            await engine.resume()
            rest = await engine.generate(req(
                "rest", PROMPTS["c"] + partial.token_ids, max_tokens=40 - len(partial.token_ids)
            ))  # fmt: skip
            return full, partial, rest

    full, partial, rest = asyncio.run(main())
    assert partial.finish_reason == "abort" and 4 <= len(partial.token_ids) < 40
    assert partial.token_ids == full.token_ids[: len(partial.token_ids)]
    assert partial.versions == [0] * len(partial.token_ids)
    assert partial.token_ids + rest.token_ids == full.token_ids


def test_wait_mode_finishes_in_flight_requests_and_holds_new_ones_until_resume(model, kv):
    async def main():
        with HFEngine(model, **kv) as engine:
            task = await long_and_clock(engine, long=12)
            await engine.pause("wait")
            assert task.done()  # the in-flight request finished before the pause returned
            assert (task.result().finish_reason, len(task.result().token_ids)) == ("length", 12)
            assert await engine.is_paused()
            held = asyncio.ensure_future(engine.generate(req("new", PROMPTS["a"], max_tokens=5)))
            await asyncio.sleep(0)  # let it be submitted
            count = await steps(engine)
            assert await engine.abort_requests(["nobody"]) == 0  # a round trip of its thread
            stats = await engine.statistics()
            assert (stats.waiting, stats.running, stats.steps) == (1, 0, count)
            assert not held.done()
            await engine.resume()
            return await held

    done = asyncio.run(main())
    assert done.token_ids == reference(model, PROMPTS["a"], 5)[0]


def test_abort_requests_ends_the_named_requests_with_their_tokens_so_far(model, kv):
    async def main():
        with HFEngine(model, **kv) as engine:
            other = asyncio.ensure_future(
                engine.generate(req("other", PROMPTS["a"], max_tokens=30))
            )
            task = await long_and_clock(engine)
            assert await engine.abort_requests(["long", "nobody"]) == 1
            aborted = await task
            assert not other.done()
            await engine.pause()
            queued = asyncio.ensure_future(engine.generate(req("queued", PROMPTS["b"])))
            await asyncio.sleep(0)
            assert await engine.abort_requests() == 2  # "other" (held) and "queued"
            return aborted, await other, await queued, await engine.statistics()

    aborted, other, queued, stats = asyncio.run(main())
    assert aborted.finish_reason == "abort" and 4 <= len(aborted.token_ids) < 40
    assert other.finish_reason == "abort" and len(other.token_ids) < 30
    assert (queued.token_ids, queued.finish_reason, queued.versions) == ([], "abort", [])
    assert (stats.aborted, stats.finished, stats.running, stats.waiting) == (3, 1, 0, 0)


def test_a_cancelled_generate_aborts_its_request(model, kv):
    async def main():
        with HFEngine(model, **kv) as engine:
            task = await long_and_clock(engine, long=200)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await engine.pause()  # at a boundary: the abort was applied before it
            return await engine.statistics()

    stats = asyncio.run(main())
    assert (stats.running, stats.aborted) == (0, 1)


# -- errors and end of life ----------------------------------------------------------------------


def test_bad_requests_are_refused_with_their_reason(model):
    async def main():
        with HFEngine(model, name="e", max_model_len=32) as engine:
            with pytest.raises(TypeError) as e:
                await engine.generate({"request_id": "x"})
            assert str(e.value) == "generate: expected a GenerateRequest, got dict"
            with pytest.raises(ValueError) as e:
                await engine.generate(req("x", [1, 64, 2]))
            assert str(e.value) == (
                "request `x`: prompt_ids[1]: expected a token id below 64 (the model's "
                "vocab_size), got 64"
            )
            with pytest.raises(ValueError) as e:
                await engine.generate(req("x", [1] * 20, max_tokens=13))
            assert str(e.value) == (
                "request `x`: expected prompt + max_tokens <= 32 (the engine's max_model_len), "
                "got 20 + 13 = 33 (shorten the prompt or lower max_tokens)"
            )
            await engine.pause()
            held = asyncio.ensure_future(engine.generate(req("x", [1], max_tokens=4)))
            await asyncio.sleep(0)
            with pytest.raises(ValueError) as e:
                await engine.generate(req("x", [2], max_tokens=4))
            assert str(e.value) == (
                "request `x`: expected a request_id not in flight on engine `e`, got one that "
                "is (request ids are unique per engine)"
            )
            with pytest.raises(ValueError) as e:
                await engine.pause("stop")
            assert str(e.value) == "pause: mode: expected 'keep', 'abort' or 'wait', got 'stop'"
            with pytest.raises(TypeError) as e:
                await engine.abort_requests("x")
            assert str(e.value) == (
                "abort_requests: expected a sequence of request ids or None, got str"
            )
            await engine.resume()
            assert len((await held).token_ids) == 4  # the refusals left it alone

    asyncio.run(main())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch": 0}, "HFEngine.max_batch: expected an int >= 1, got 0"),
        ({"version": -1}, "HFEngine.version: expected an int >= 0, got -1"),
        ({"max_model_len": 1}, "HFEngine.max_model_len: expected None or an int >= 2, got 1"),
        ({"name": ""}, "HFEngine.name: expected a non-empty str, got ''"),
        ({"device": "gpu0"}, "HFEngine.device: expected a torch device such as 'cuda:0' or "
                             "'cpu', got 'gpu0'"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_with_their_reason(model, kwargs, message):
    with pytest.raises(ValueError) as e:
        HFEngine(model, **kwargs)
    assert str(e.value) == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_a_cuda_device_without_cuda_is_refused(model):
    with pytest.raises(ValueError) as e:
        HFEngine(model, device="cuda")
    assert str(e.value) == (
        "HFEngine.device: expected a device this torch can use, got 'cuda' "
        "(torch.cuda.is_available() is False)"
    )


def test_a_model_is_a_causal_lm_or_a_local_directory(model, tmp_path):
    with pytest.raises(ValueError) as e:
        HFEngine(torch.nn.Linear(2, 2))
    assert str(e.value) == (
        "HFEngine.model: expected a transformers causal LM or a local directory, got Linear"
    )
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    ))  # fmt: skip
    with pytest.raises(ValueError) as e:
        HFEngine(bert)
    assert str(e.value) == (
        "HFEngine.model: expected a transformers causal LM or a local directory, got BertModel"
    )
    with pytest.raises(ValueError) as e:
        HFEngine(str(tmp_path / "nowhere"))
    assert str(e.value) == (
        "HFEngine.model: expected a transformers causal LM or a local directory, got "
        f"'{tmp_path / 'nowhere'}', which is not a directory (nothing is downloaded)"
    )
    model.save_pretrained(tmp_path / "tiny")

    async def main():
        with HFEngine(tmp_path / "tiny") as engine:
            return await engine.generate(req("a", PROMPTS["a"], max_tokens=8))

    assert asyncio.run(main()).token_ids == reference(model, PROMPTS["a"], 8)[0]


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on():
    """GPT-2 has 16 learned positions; an engine told it may go to 64 meets an index
    error at position 16, a real failure of a step."""
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=16)
    ).eval()

    async def main():
        with HFEngine(gpt2, name="e", max_model_len=64) as engine:
            with pytest.raises(EngineError) as e:
                await engine.generate(req("long", PROMPTS["c"], max_tokens=20))
            short = await engine.generate(req("short", PROMPTS["a"], max_tokens=4))
            return str(e.value), short, await engine.statistics()

    error, short, stats = asyncio.run(main())
    assert error == (
        "engine `e`: a step failed: IndexError: index out of range in self (the request's "
        "tokens are lost: resubmit it)"
    )
    assert stats.last_error == "a step failed: IndexError: index out of range in self"
    assert len(short.token_ids) == 4 and (stats.running, stats.finished) == (0, 1)


def test_close_fails_the_requests_in_flight_and_every_later_call(model):
    async def main():
        engine = HFEngine(model, name="e")
        running = await long_and_clock(engine, long=200)
        await engine.pause()
        queued = asyncio.ensure_future(engine.generate(req("queued", PROMPTS["a"])))
        await asyncio.sleep(0)
        engine.close()
        for task in (running, queued):
            with pytest.raises(EngineError) as e:
                await task
            assert str(e.value) == (
                "engine `e`: closed (make a new engine): the request ended unfinished (resubmit it)"
            )
        with pytest.raises(EngineError) as e:
            await engine.generate(req("late", PROMPTS["a"]))
        assert str(e.value) == "engine `e`: closed (make a new engine)"
        with pytest.raises(EngineError):
            await engine.pause()
        engine.close()  # twice is fine

    asyncio.run(main())


def test_async_with_closes_the_engine_and_later_calls_raise_closed(model):
    async def main():
        async with HFEngine(model, name="e") as engine:
            done = await engine.generate(req("r", PROMPTS["a"], max_tokens=2))
            assert len(done.token_ids) == 2
        await engine.aclose()  # a second close does nothing
        with pytest.raises(EngineClosed) as e:
            await engine.generate(req("late", PROMPTS["a"]))
        assert isinstance(e.value, errors.Closed) and e.value.gone
        assert str(e.value) == "engine `e`: closed (make a new engine)"

    asyncio.run(main())


def test_waiting_rows_join_a_decoding_batch_together_not_one_by_one():
    from rlferry.engines.hf._thread import JOIN_AFTER, joining

    assert joining(running=0, joinable=1, deferred=0)  # nothing decodes: at once
    assert not joining(running=128, joinable=8, deferred=0)  # a prefill for 8 of 136: later
    assert joining(running=128, joinable=32, deferred=0)  # a quarter of the batch: now
    assert joining(running=128, joinable=1, deferred=JOIN_AFTER)  # waited long enough
    assert not joining(running=5, joinable=0, deferred=JOIN_AFTER)  # nobody to join


def _family_model(family):
    """A tiny random model of ``family`` (``llama`` or ``qwen3``: q and k norms too)."""
    torch.manual_seed(0)
    if family == "llama":
        return tiny_model(0)
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_rms_norms_give_transformers_values_bit_for_bit(family):
    from rlferry.engines.hf._kernels import fuse_rms_norms

    model = _family_model(family)
    for p in model.parameters():  # norms of weights other than ones
        torch.nn.init.normal_(p)
    model = model.to(torch.bfloat16).eval()
    ids = torch.randint(0, 64, (3, 7))
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        n = fuse_rms_norms(model)
        after = model(input_ids=ids).logits
    assert n == (2 * 2 + 1 if family == "llama" else 4 * 2 + 1)  # qwen3: q_norm and k_norm too
    assert torch.equal(before, after)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rotary_on_q_and_k_together_gives_transformers_values_bit_for_bit(family, monkeypatch):
    import sys

    from rlferry.engines.hf._kernels import fuse_rotary

    model = _family_model(family)
    model = model.to(torch.bfloat16).eval()
    module = sys.modules[type(model).__module__]
    monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)  # undone
    ids = torch.randint(0, 64, (3, 7))
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert fuse_rotary(model)
        assert hasattr(module.apply_rotary_pos_emb, "rlferry_original")
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


@pytest.mark.slow  # inductor's C++ compiler here, ~20 s; Triton on CUDA
def test_compiled_norms_and_mlps_give_the_values_of_transformers_operators():
    """A slot cache on CUDA compiles its norms and its MLPs' ``silu(gate) * up``; compiled
    (here for the CPU) they give the values of transformers' operators."""
    from rlferry.engines.hf import _kernels as k

    torch.manual_seed(0)
    model = _family_model("qwen3").to(torch.bfloat16).eval()
    assert k.fuse_rms_norms(model, compiled=True) == 4 * 2 + 1 and k.fuse_mlps(model) == 2
    norm, mlp = model.model.layers[0].self_attn.q_norm, model.model.layers[0].mlp
    for rows in ((3, 7), (1, 1), (5, 1)):  # rows and widths of one compilation
        x = torch.randn(*rows, 4, 8, dtype=torch.bfloat16) * 3
        want = type(norm).forward(norm, x)  # transformers' own
        torch.testing.assert_close(norm(x), want)
        x = torch.randn(*rows, 32, dtype=torch.bfloat16)
        torch.testing.assert_close(mlp(x), type(mlp).forward(mlp, x))


def test_a_decode_steps_span_follows_its_longest_row_as_rows_join_and_leave(model):
    """The columns a step runs on are tracked without a pass over the rows per step: they
    equal the span of the longest row (prompt and tokens) at every step."""
    from rlferry.engines.hf._batch import Row
    from rlferry.engines.hf._slots import SlotBatch

    batch = SlotBatch(model, torch.device("cpu"), max_batch=4, max_len=160, graphs=False)

    def row(rid, n, new):
        return Row(req(rid, [1 + i % 60 for i in range(n)], max_tokens=new), None, None)

    def check():
        longest = max((len(r.request.prompt_ids) + len(r.tokens) for r in batch.rows), default=1)
        assert batch.step_key() == (batch._bucket(len(batch.rows)), batch._span(longest))

    spans = set()
    with torch.inference_mode():
        batch.prefill([row("a", 10, 40), row("b", 60, 5)], 0)
        for _ in range(8):  # b (the longest) leaves after 5 tokens: the span shrinks
            check()
            spans.add(batch.step_key()[1])
            batch.decode(0)
        batch.prefill([row("c", 100, 30)], 0)  # a longer one joins
        for _ in range(30):
            check()
            spans.add(batch.step_key()[1])
            batch.decode(0)
        batch.remove(list(batch.rows))
        check()
    assert spans == {16, 32, 64, 128, 160}  # powers of two to 64, then its multiples
