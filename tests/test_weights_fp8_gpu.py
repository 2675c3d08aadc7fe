"""Block FP8 on a GPU, on the device machine: the Triton quantizer bit for bit against the
plain loop, trainer ranks that quantize on their GPU and push over cuda_ipc into engine
ranks' GPU tensors, and an FP8 engine's logits on the GPU against bf16's.

Skipped on CPU (with the reason); run there with
`python -m pytest -q tests/test_weights_fp8_gpu.py`.
"""

import threading

import pytest
import torch

from conftest import requires_cuda
from rlferry.weights import ShardedReceiver, ShardedSender, fsdp_layout, specs_of, tp_layout
from rlferry.weights.copies import quantize_block_fp8
from rlferry.weights.planning import BLOCK_FP8, EngineLayout
from rlferry.weights.planning._boxes import slices
from test_weights_fp8 import (
    BF16,
    expected,
    fp8_engine,
    full_tensors,
    layer_specs,
    max_relative_error,
    reference_quantize,
    same_bits,
    tiny_qwen3,
    weight,
)
from test_weights_gpu import _answer, _start

pytestmark = [requires_cuda, pytest.mark.gpu]


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((256, 384), BF16), ((300, 200), BF16), ((1, 1), BF16), ((129, 127), torch.float32),
     ((3, 256, 130), BF16), ((2, 2, 140, 260), torch.float16), ((4096, 1024), BF16)],
)  # fmt: skip
def test_the_kernel_matches_the_plain_loop_and_the_torch_ops_bit_for_bit(shape, dtype):
    w = weight(shape, dtype)
    rq, rs = reference_quantize(w)
    q, s = quantize_block_fp8(w.cuda(), kernel=True)
    tq, ts = quantize_block_fp8(w.cuda(), kernel=False)
    assert same_bits(q.cpu(), rq) and same_bits(s.cpu(), rs)
    assert same_bits(tq.cpu(), rq) and same_bits(ts.cpu(), rs)


def test_the_kernel_reads_a_strided_view_where_it_lies():
    w = weight((3, 300, 520))[:, 10:290, 3:400]
    q, s = quantize_block_fp8(w.cuda(), kernel=True)
    rq, rs = reference_quantize(w.contiguous())
    assert same_bits(q.cpu(), rq) and same_bits(s.cpu(), rs)


def layouts(kind):
    """The specs, trainer layout and engine layout of a test: ``layers`` (2 trainer ranks
    to a TP=2 engine) or ``qwen`` (2 trainer ranks to one engine, a tiny Qwen3)."""
    if kind == "layers":
        specs = layer_specs()
        return specs, fsdp_layout(specs, 2), tp_layout(specs, 2, dtype=BLOCK_FP8)
    specs = specs_of(tiny_qwen3()[0].state_dict().items())
    return specs, fsdp_layout(specs, 2), EngineLayout.whole(specs, dtype=BLOCK_FP8)


def _gpu_trainer(kind, conn):
    """Two trainer ranks on GPU 0 over cuda_ipc: each quantizes its shards there."""
    torch.cuda.set_device(0)
    specs, trainer, engine = layouts(kind)
    senders = [ShardedSender(group=f"fp8-gpu-{kind}", rank=r, trainer=trainer, engine=engine,
                             transport="cuda_ipc", device="cuda:0") for r in range(2)]  # fmt: skip
    conn.send([s.address for s in senders])
    while (v := conn.recv()) != "stop":
        full = full_tensors(specs, v) if kind == "layers" else tiny_qwen3()[0].state_dict()
        shards = [{n: full[n][slices(b)].cuda() for n, b in trainer.owned[r].items()}
                  for r in range(2)]  # fmt: skip
        threads = [threading.Thread(target=s.push, args=(shards[r],), kwargs={"version": v})
                   for r, s in enumerate(senders)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        conn.send(("pushed", v))
    for s in senders:
        s.close()


def engine_ranks(kind, addresses, params):
    _, trainer, engine = layouts(kind)
    return [
        ShardedReceiver(group=f"fp8-gpu-{kind}", rank=r, trainer=trainer, engine=engine,
                        params=params[r], addresses=addresses, device="cuda:0").start(120)
        for r in range(len(engine.receivers))
    ]  # fmt: skip


def push_version(conn, v):
    conn.send(v)
    assert _answer(conn) == ("pushed", v)


def test_gpu_trainer_ranks_quantize_and_push_block_fp8_into_a_tp2_engine_bit_for_bit():
    specs, _, engine = layouts("layers")
    params = [{n: torch.zeros(s.shape, dtype=s.dtype, device="cuda")
               for n, s in engine.param_specs(r).items()} for r in range(2)]  # fmt: skip
    proc, conn = _start(_gpu_trainer, "layers")
    receivers = []
    try:
        receivers = engine_ranks("layers", _answer(conn), params)
        for v in (1, 2):
            push_version(conn, v)
            full = full_tensors(specs, v)
            for r, recv in enumerate(receivers):
                assert recv.wait_for(v, 120)
                want = expected(engine, r, full)
                bad = [n for n in want if not same_bits(params[r][n].cpu(), want[n])]
                assert not bad, bad
    finally:
        conn.send("stop")
        for x in receivers:
            x.close()
        proc.join(60)


def test_an_fp8_engine_on_the_gpu_loaded_by_a_push_gives_logits_within_a_tenth_of_bf16s():
    model, prompts = tiny_qwen3("cuda")
    engine = fp8_engine(model)
    proc, conn = _start(_gpu_trainer, "qwen")
    receivers = []
    try:
        receivers = engine_ranks("qwen", _answer(conn), [engine.state_dict()])
        push_version(conn, 1)
        assert receivers[0].wait_for(1, 120)
    finally:
        conn.send("stop")
        for x in receivers:
            x.close()
        proc.join(60)
    with torch.no_grad():
        want, got = model(prompts).logits, engine(prompts).logits
    # the CPU's bound (test_weights_fp8), on the GPU's bf16 arithmetic
    assert max_relative_error(got, want) < 0.1
