"""The demo's training step: fixed-shape batches, the step eager on the CPU and as a CUDA
graph on a GPU (against the eager step), and its roofline estimate."""

import copy
import random

import pytest
import torch

from rlferry.rl.grpo import GrpoBatch, PaddedBatch, grpo_loss, pad_batch
from rlferry.rl.model import make_model, model_config, transformers_module
from rlferry.rl.task import ReverseTask
from rlferry.rl.trainer._roofline import Peaks, measure_peaks, step_roofline
from rlferry.rl.trainer._step import TrainStep

TASK = ReverseTask()
VOCAB = TASK.tokenizer.vocab_size
WIDTH = TASK.length + 1 + TASK.max_tokens


def batches(rows, n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompts = [p.ids for p in TASK.sample(rows, rng)]
        responses = [
            [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, TASK.max_tokens))]
            for _ in range(rows)
        ]
        responses[0] = responses[0] or [1]  # at least one response token
        logprobs = [[-2.0 - rng.random() for _ in r] for r in responses]
        out.append(GrpoBatch(prompts, responses, logprobs, [rng.gauss(0, 1) for _ in range(rows)]))
    return out


def test_padded_batch_places_every_token_and_the_engine_logprobs():
    b = GrpoBatch([[3, 4], [5]], [[6, 1], []], [[-0.5, -0.25], []], [1.0, -1.0])
    p = PaddedBatch.of(b, 5)
    assert p.input_ids.tolist() == [[3, 4, 6, 1, 0], [5, 0, 0, 0, 0]]
    assert p.response_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]]
    assert p.logprobs.tolist() == [[0, 0, -0.5, -0.25, 0], [0, 0, 0, 0, 0]]
    assert p.advantages.tolist() == [[1.0], [-1.0]]
    assert p.tokens == 2 and float(p.count) == 2.0
    ids, attention, response = pad_batch([[3, 4], [5]], [[6, 1], []], width=5)
    assert ids.tolist() == p.input_ids.tolist()
    assert attention.tolist() == [[True] * 4 + [False], [True] + [False] * 4]
    assert response.tolist() == p.response_mask.bool().tolist()


def test_padded_batch_is_the_same_from_lists_tensors_and_arrays():
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(40)]
    responses = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 5))] for _ in range(40)]
    logprobs = [[-rng.random() for _ in r] for r in responses]
    adv = [rng.gauss(0, 1) for _ in range(40)]
    want = PaddedBatch.of(GrpoBatch(prompts, responses, logprobs, adv), 12)
    as_rows = {  # the queue's ragged columns are a 1-D tensor a row
        "tensors": lambda xs, dt: [torch.tensor(x, dtype=dt) for x in xs],
        "column tensors": lambda xs, dt: [torch.tensor(x, dtype=dt).view(-1, 1) for x in xs],
        "arrays": lambda xs, dt: [torch.tensor(x, dtype=dt).numpy() for x in xs],
        "tuples": lambda xs, dt: [tuple(x) for x in xs],
    }
    for name, rows in as_rows.items():
        got = PaddedBatch.of(GrpoBatch(rows(prompts, torch.long), rows(responses, torch.long),
                                       rows(logprobs, torch.float32), adv), 12)  # fmt: skip
        assert got.tokens == want.tokens, name
        for a, b in zip(got.tensors(), want.tensors(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name


def test_short_attention_is_sdpa_forward_and_backward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rlferry.rl.trainer._attention import SHORT, short_attention

    class Layer(torch.nn.Module):  # what the attention functions read of a layer
        is_causal = True
        num_key_value_groups = 4

    torch.manual_seed(0)
    for rows, width in ((5, 1), (3, 12), (2, SHORT + 3)):  # the last goes to SDPA itself
        q = torch.randn(rows, 8, width, 16, requires_grad=True)
        kv = [torch.randn(rows, 2, width, 16, requires_grad=True) for _ in range(2)]
        mask = torch.ones((width, width), dtype=torch.bool).tril()[None, None]
        outs = []
        for fn in (sdpa_attention_forward, short_attention):
            out, _ = fn(Layer(), q, *kv, mask, scaling=0.3)
            outs.append((out, torch.autograd.grad(out.square().sum(), (q, *kv))))
        (want, want_grads), (got, grads) = outs
        assert got.shape == want.shape == (rows, width, 8, 16)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_model_attending_through_short_attention_trains_as_with_sdpa():
    from rlferry.rl.trainer._attention import SHORT_ATTENTION, use_short_attention

    tf = transformers_module()
    config = model_config("qwen3-0.6b", VOCAB)
    config.update({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})  # fmt: skip
    torch.manual_seed(0)
    base = tf.Qwen3ForCausalLM(config).train()
    short = copy.deepcopy(base)
    use_short_attention(short)
    assert short.config._attn_implementation == SHORT_ATTENTION
    batch = batches(8, 1, seed=2)[0]
    grads = []
    for model in (base, short):
        loss, _ = grpo_loss(model, batch)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for g, w in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_a_row_longer_than_the_width_is_refused_naming_it():
    b = GrpoBatch([[3, 4], [5, 6, 7]], [[6, 1], [8, 9, 1]], [[0.0] * 2, [0.0] * 3], [1.0, 1.0])
    with pytest.raises(ValueError) as e:
        PaddedBatch.of(b, 5)
    assert str(e.value) == (
        "PaddedBatch.width: expected every prompt + response to fit in 5 tokens, row 1 has 6 "
        "(pad to a wider width, or cap max_tokens)"
    )


def test_the_eager_step_is_grpo_loss_backward_clipping_and_adamw():
    model = make_model("tiny", VOCAB, seed=0).train()
    mine = copy.deepcopy(model)
    params = list(mine.parameters())
    step = TrainStep(mine, params, torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0),
                     rows=8, width=WIDTH, clip=0.2, autocast=None, graphed=False)  # fmt: skip
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for b in batches(8, 3):
        stats = step(b)
        ref_opt.zero_grad(set_to_none=True)
        loss, ref = grpo_loss(model, b, clip=0.2)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        ref_opt.step()
        assert stats.tokens == ref.tokens
        assert stats.loss == pytest.approx(ref.loss, rel=1e-4, abs=1e-6)
        assert stats.entropy == pytest.approx(ref.entropy, rel=1e-4)
    for x, y in zip(mine.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    assert step.replayed == 0


def test_a_step_refuses_a_batch_of_another_size_or_without_response_tokens():
    model = make_model("tiny", VOCAB, seed=0).train()
    params = list(model.parameters())
    step = TrainStep(model, params, torch.optim.AdamW(params), rows=8, width=WIDTH, clip=0.2,
                     autocast=None, graphed=False)  # fmt: skip
    with pytest.raises(ValueError) as e:
        step(batches(4, 1)[0])
    assert str(e.value) == "TrainStep: expected 8 sequences (the rank's share of a step), got 4"
    empty = GrpoBatch([[3]] * 8, [[]] * 8, [[]] * 8, [1.0] * 8)
    with pytest.raises(ValueError) as e:
        step(empty)
    assert str(e.value) == (
        "TrainStep.batch: expected at least one response token, got 0 (every response is empty)"
    )
    with pytest.raises(ValueError) as e:
        TrainStep(model, params, torch.optim.AdamW(params), rows=8, width=WIDTH, clip=0.2,
                  autocast=None, graphed=True)  # fmt: skip
    assert str(e.value) == "TrainStep.graphed: a CUDA graph needs a CUDA model and no adapter"


def test_the_roofline_counts_six_flops_a_weight_a_token_and_the_optimizer_bytes():
    tf = transformers_module()
    with torch.device("meta"):
        model = tf.Qwen3ForCausalLM(model_config("qwen3-0.6b", VOCAB))
    peaks = Peaks(flops=1e15, bandwidth=4e12, dtype="bfloat16")
    roof = step_roofline(model, 128, 12, low=True, peaks=peaks)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    params = sum(p.numel() for p in model.parameters())
    attention = 3 * 2 * 128 * 12**2 * 16 * 128 * 28
    assert roof.flops == 6 * linear * 128 * 12 + attention
    assert roof.bytes == params * 58 + 2 * 34 * 1024 * 128 * 12 * 28
    assert roof.seconds == pytest.approx(roof.flops / 1e15 + roof.bytes / 4e12)
    cpu = measure_peaks(torch.device("cpu"), torch.float32)
    assert cpu.flops > 1e8 and cpu.bandwidth > 1e8 and cpu.dtype == "float32"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a CUDA GPU")
def test_the_graphed_step_trains_as_the_eager_one_does():
    tf = transformers_module()
    config = model_config("qwen3-0.6b", VOCAB)
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    base = tf.Qwen3ForCausalLM(config).to("cuda").train()
    runs, steps = {}, {}
    data = batches(64, 6, seed=1)
    for graphed in (False, True):
        model = copy.deepcopy(base)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True, capturable=graphed)
        step = TrainStep(model, params, opt, rows=64, width=WIDTH, clip=0.2,
                         autocast=torch.bfloat16, graphed=graphed)  # fmt: skip
        runs[graphed] = ([step(b) for b in data], model, step.replayed)
        steps[graphed] = step
    (eager, m0, r0), (graph, m1, r1) = runs[False], runs[True]
    assert (r0, r1) == (0, len(data))
    # compiled layers round otherwise than eager ones (bfloat16): the figures agree
    # closely, and the two runs' weights lie far closer to each other than to the start
    for a, b in zip(eager, graph, strict=True):
        assert a.tokens == b.tokens
        assert a.entropy == pytest.approx(b.entropy, rel=0.02), (a, b)
        assert a.loss == pytest.approx(b.loss, abs=0.05), (a, b)
    moved = sum(float((x - w).float().norm() ** 2) for x, w in zip(m0.parameters(),
                base.parameters(), strict=True)) ** 0.5  # fmt: skip
    apart = sum(float((x - y).float().norm() ** 2) for x, y in zip(m0.parameters(),
                m1.parameters(), strict=True)) ** 0.5  # fmt: skip
    assert moved > 0 and apart < 0.5 * moved, (apart, moved)
    # what a push sends: the graph's cast of the weights after its last step
    named = dict(m1.state_dict())
    for name, t in steps[True].served:
        assert t.dtype == torch.bfloat16 and torch.equal(t, named[name].to(torch.bfloat16)), name
