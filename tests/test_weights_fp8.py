"""Block FP8: the quantizer bit for bit against a plain loop, the layouts and plans that
keep linear weights as ``weight`` + ``weight_scale_inv``, sharded pushes into them, the
errors that name what block FP8 cannot serve, and an FP8 engine's logits against bf16's."""

import copy

import pytest
import torch

from rlferry.weights import (
    ShardedReceiver,
    ShardedSender,
    WeightSyncError,
    fsdp_layout,
    specs_of,
    tp_layout,
)
from rlferry.weights.copies import dequantize_block_fp8, quantize_block_fp8
from rlferry.weights.planning import (
    BLOCK_FP8,
    BlockFP8Error,
    EngineLayout,
    ParamLayout,
    Part,
    ShardPlan,
    TensorSpec,
    TrainerLayout,
)
from rlferry.weights.planning._boxes import extents, slices
from test_weights_sharded import push_threads

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
WAIT = 60


def reference_quantize(w):
    """Block FP8 written plainly: one block at a time, float32 scalars."""
    *lead, rows, cols = w.shape
    flat = w.reshape(-1, rows, cols)
    q = torch.empty(flat.shape, dtype=FP8)
    s = torch.empty(flat.shape[0], -(-rows // 128), -(-cols // 128))
    inv_448 = torch.tensor(1 / 448, dtype=torch.float32)
    for m in range(flat.shape[0]):
        for i in range(0, rows, 128):
            for j in range(0, cols, 128):
                block = flat[m, i : i + 128, j : j + 128].float()
                amax = torch.clamp(block.abs().max(), min=1e-4)
                scale = amax * inv_448
                q[m, i : i + 128, j : j + 128] = (block * (1 / scale)).to(FP8)
                s[m, i // 128, j // 128] = scale
    return q.reshape(w.shape), s.reshape(*lead, *s.shape[1:])


def same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == FP8:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def weight(shape, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])  # blocks of all sizes
    return w.to(dtype)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((256, 384), BF16), ((300, 200), BF16), ((1, 1), BF16), ((129, 127), torch.float32),
     ((3, 256, 130), BF16), ((2, 2, 140, 260), torch.float16)],
)  # fmt: skip
def test_the_quantizer_matches_a_plain_loop_over_blocks_bit_for_bit(shape, dtype):
    w = weight(shape, dtype)
    q, s = quantize_block_fp8(w)
    rq, rs = reference_quantize(w)
    assert q.shape == w.shape
    assert s.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    assert same_bits(q, rq) and same_bits(s, rs)


def test_a_strided_view_quantizes_as_its_contiguous_copy():
    w = weight((3, 300, 520))[:, 10:290, 3:400]  # a rank's rows and columns of a stack
    q, s = quantize_block_fp8(w)
    rq, rs = reference_quantize(w.contiguous())
    assert same_bits(q, rq) and same_bits(s, rs)


def test_zero_tiny_and_huge_blocks_get_vllms_scales():
    w = torch.zeros(256, 384, dtype=BF16)
    w[128:, :128] = 1e-6  # amax below the floor: scaled by 1e-4 / 448
    w[:128, 128:256] = 3e4
    w[128:, 256:] = torch.linspace(-5, 5, 128 * 128).reshape(128, 128)
    q, s = quantize_block_fp8(w)
    floor = torch.tensor(1e-4) * torch.tensor(1 / 448)
    assert s[0, 0] == floor and not q[:128, :128].float().any()  # all zero: zeros
    assert s[1, 0] == floor
    assert s[0, 1] == torch.tensor(3e4, dtype=BF16).float() * torch.tensor(1 / 448)
    assert q[:128, 128:256].float().eq(448).all()  # the amax maps to the largest fp8
    back = dequantize_block_fp8(q, s, torch.float32)
    err = (back - w.float()).abs() / w.float().abs().clamp(min=1e-30)
    assert float(err[w != 0].max()) <= 2**-4  # e4m3: 3 bits of mantissa, rounded


def layer_specs(hidden=256, inter=512, kv=256, dtype=BF16):
    p = "model.layers.0."
    return [
        TensorSpec("model.embed_tokens.weight", (300, hidden), dtype),
        TensorSpec(p + "self_attn.q_proj.weight", (hidden, hidden), dtype),
        TensorSpec(p + "self_attn.k_proj.weight", (kv, hidden), dtype),
        TensorSpec(p + "self_attn.v_proj.weight", (kv, hidden), dtype),
        TensorSpec(p + "self_attn.o_proj.weight", (hidden, hidden), dtype),
        TensorSpec(p + "mlp.gate_proj.weight", (inter, hidden), dtype),
        TensorSpec(p + "mlp.up_proj.weight", (inter, hidden), dtype),
        TensorSpec(p + "mlp.down_proj.weight", (hidden, inter), dtype),
        TensorSpec(p + "mlp.experts.gate_up_proj", (2, 512, hidden), dtype),
        TensorSpec(p + "mlp.experts.down_proj", (2, hidden, 256), dtype),
        TensorSpec(p + "mlp.gate.weight", (2, hidden), dtype),
        TensorSpec(p + "input_layernorm.weight", (hidden,), dtype),
        TensorSpec("lm_head.weight", (300, hidden), dtype),
    ]


def full_tensors(specs, seed=0):
    return {s.name: weight(s.shape, s.dtype, seed + i) for i, s in enumerate(specs)}


def expected(engine, r, full):
    """Receiver ``r``'s tensors: each parameter assembled from the full tensors, then
    quantized whole by the reference when the layout keeps it in block FP8."""
    out = {}
    for p in engine.receivers[r]:
        src = full[p.parts[0].source]
        t = torch.zeros(p.shape, dtype=src.dtype)
        for q in p.parts:
            t[slices(q.at)] = full[q.source][slices(q.box)].reshape(extents(q.at))
        if p.quantize is None:
            out[p.name] = t.to(p.dtype)
        else:
            out[p.name], out[p.name + "_scale_inv"] = reference_quantize(t)
    return out


def test_fp8_block128_keeps_linear_weights_in_block_fp8_and_the_rest_as_they_are():
    engine = tp_layout(layer_specs(), 2, dtype=BLOCK_FP8)
    params = {p.name: p for p in engine.receivers[0]}
    block = sorted(n for n, p in params.items() if p.quantize == "block128")
    assert block == sorted(
        f"model.layers.0.{n}" for n in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_up_proj.weight", "mlp.down_proj.weight", "mlp.experts.w13_weight",
        "mlp.experts.w2_weight")
    )  # fmt: skip
    assert all(params[n].dtype == FP8 for n in block)
    assert {params[n].dtype for n in params if n not in block} == {BF16}  # norms, embeddings
    specs = engine.param_specs(0)
    assert specs["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == TensorSpec(
        "model.layers.0.self_attn.qkv_proj.weight_scale_inv", (3, 2), torch.float32
    )  # 384 rows (128 of q, k and v each) x 256 columns
    assert specs["model.layers.0.mlp.experts.w2_weight_scale_inv"].shape == (2, 2, 1)
    whole = EngineLayout.whole(layer_specs(), dtype={"lm_head.weight": BLOCK_FP8})
    assert [p.name for p in whole.receivers[0] if p.quantize] == ["lm_head.weight"]


def test_a_tp_slice_that_is_not_whole_blocks_is_refused_by_name():
    with pytest.raises(BlockFP8Error, match=r"qkv_proj.weight'\]\.parts\[1\]\.box: expected a "
                       r"region of whole 128 x 128 blocks.*got \[0:64, 0:256\]"):  # fmt: skip
        tp_layout(layer_specs(kv=128), 2, dtype=BLOCK_FP8)  # k_proj: 64 rows a rank
    norm = TensorSpec("norm.weight", (256,), BF16)
    with pytest.raises(BlockFP8Error, match="of a float8_e4m3fn parameter of 2 dims or more"):
        EngineLayout((norm,), ((ParamLayout("norm.weight", (256,), FP8,
                                            (Part("norm.weight", ((0, 256),), ((0, 256),)),),
                                            "block128"),),))  # fmt: skip
    with pytest.raises(ValueError, match="expected a torch dtype or 'fp8_block128'"):
        tp_layout(layer_specs(), 2, dtype="fp8")


def test_a_block_two_trainer_ranks_hold_parts_of_is_refused_naming_the_rank():
    specs = [TensorSpec("model.layers.0.mlp.down_proj.weight", (384, 256), BF16)]
    with pytest.raises(BlockFP8Error) as e:
        ShardPlan.build(fsdp_layout(specs, 2), tp_layout(specs, 1, dtype=BLOCK_FP8))
    assert str(e.value).startswith(
        "tensor `model.layers.0.mlp.down_proj.weight`: trainer rank 0 owns [0:192, 0:256] of "
        "it, which cuts 128 x 128 blocks that receiver 0 keeps in block FP8 for "
        "`model.layers.0.mlp.down_proj.weight`"
    )
    assert isinstance(e.value, ValueError) and isinstance(e.value, WeightSyncError)
    ShardPlan.build(fsdp_layout(specs, 3), tp_layout(specs, 1, dtype=BLOCK_FP8))  # 128 a rank


def test_block_fp8_sends_a_byte_an_element_and_four_a_block():
    specs = layer_specs()
    plan = ShardPlan.build(fsdp_layout(specs, 2), tp_layout(specs, 2, dtype=BLOCK_FP8))
    block = [s for s in specs if "_proj" in s.name]
    other = [s for s in specs if "_proj" not in s.name]
    elements = sum(s.nbytes // 2 for s in block)
    blocks = sum(s.nbytes // 2 // 128**2 for s in block)  # every shape here is whole blocks
    assert sum(plan.stream_bytes(s) for s in range(2)) == (
        elements + 4 * blocks + sum(s.nbytes for s in other)
    )
    names = [p.name for p in plan.streams[0]]
    i = names.index("model.layers.0.mlp.down_proj.weight[0:128, 0:512]:fp8_block128")
    assert names[i + 1] == names[i] + ":scale_inv"  # its scales follow its values


def start_engine(group, trainer, engine, senders, point_to_point, params=None):
    receivers = []
    allp = []
    for r in range(len(engine.receivers)):
        specs = engine.param_specs(r).items()
        p = params[r] if params else {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs}
        allp.append(p)
        receivers.append(ShardedReceiver(
            group=group, rank=r, trainer=trainer, engine=engine, params=p,
            addresses=[s.addresses if point_to_point else s.address for s in senders],
            point_to_point=point_to_point,
        ).start(WAIT))  # fmt: skip
    return receivers, allp


@pytest.mark.parametrize(("transport", "point_to_point"), [("shm", False), ("broadcast", True)])
def test_two_trainer_ranks_push_block_fp8_into_a_tp2_engine_bit_for_bit(transport, point_to_point):
    specs = layer_specs()
    trainer, engine = fsdp_layout(specs, 2), tp_layout(specs, 2, dtype=BLOCK_FP8)
    senders = [ShardedSender(group=f"fp8-{transport}", rank=r, trainer=trainer, engine=engine,
                             transport=transport, point_to_point=point_to_point)
               for r in range(2)]  # fmt: skip
    receivers = []
    try:
        receivers, params = start_engine(
            f"fp8-{transport}", trainer, engine, senders, point_to_point
        )
        for version in (1, 2):
            full = full_tensors(specs, version)
            shards = [{n: full[n][slices(b)].clone() for n, b in trainer.owned[r].items()}
                      for r in range(2)]  # fmt: skip
            push_threads(senders, shards, version)
            for r, recv in enumerate(receivers):
                assert recv.wait_for(version, WAIT)
                want = expected(engine, r, full)
                assert want.keys() == params[r].keys()
                bad = [n for n in want if not same_bits(params[r][n], want[n])]
                assert not bad, bad
    finally:
        for x in [*receivers, *senders]:
            x.close()


def test_a_block_fp8_push_to_an_engine_that_keeps_bf16_fails_by_name_and_it_keeps_its_version():
    specs = layer_specs()
    trainer = TrainerLayout.single(specs)
    fp8, bf16 = EngineLayout.whole(specs, dtype=BLOCK_FP8), EngineLayout.whole(specs)
    sender = ShardedSender(group="fp8-mismatch", rank=0, trainer=trainer, engine=bf16)
    receivers = []
    try:
        receivers, params = start_engine("fp8-mismatch", trainer, bf16, [sender], False)
        full = full_tensors(specs, 1)
        sender.push(full, version=1, timeout=WAIT)
        assert receivers[0].wait_for(1, WAIT)
        sender.set_layouts(engine=fp8)  # the trainer believes the engine keeps block FP8
        with pytest.raises(WeightSyncError) as e:
            sender.push(full_tensors(specs, 2), version=2, timeout=WAIT)
        reason = next(iter(e.value.failures.values()))
        assert (
            "BlockFP8Error: trainer rank 0 sends `model.layers.0.self_attn.q_proj.weight:"
            "fp8_block128` in block FP8, which this receiver's plan"
        ) in reason
        assert receivers[0].version == 1
        assert all(torch.equal(params[0][n], full[n]) for n in full)  # no byte moved
    finally:
        for x in [*receivers, sender]:
            x.close()


def test_an_engine_rank_without_the_scales_is_refused_by_name():
    specs = layer_specs()
    trainer, engine = TrainerLayout.single(specs), EngineLayout.whole(specs, dtype=BLOCK_FP8)
    params = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in engine.param_specs(0).items()}
    del params["model.layers.0.mlp.up_proj.weight_scale_inv"]
    with pytest.raises(BlockFP8Error, match=(
        r"params\['model.layers.0.mlp.up_proj.weight_scale_inv'\]: expected shape \[4, 2\] "
        r"float32, got no such tensor: the engine layout keeps `model.layers.0.mlp.up_proj."
        r"weight` in block FP8"
    )):  # fmt: skip
        ShardedReceiver(group="g", rank=0, trainer=trainer, engine=engine, params=params,
                        addresses=["tcp://127.0.0.1:1"])  # fmt: skip


class BlockFP8Linear(torch.nn.Module):
    """A linear layer as an FP8 engine keeps it: ``weight`` (float8_e4m3fn) and
    ``weight_scale_inv``; its forward dequantizes them (weight-only FP8, as vLLM serves
    block FP8 on GPUs without FP8 matrix units)."""

    def __init__(self, linear):
        super().__init__()
        shape = linear.weight.shape
        self.weight = torch.nn.Parameter(torch.zeros(shape, dtype=FP8), requires_grad=False)
        scales = torch.zeros(-(-shape[0] // 128), -(-shape[1] // 128))
        self.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x):
        w = dequantize_block_fp8(self.weight, self.weight_scale_inv, x.dtype)
        return torch.nn.functional.linear(x, w, self.bias)


def tiny_qwen3(device="cpu"):
    """A 2-layer Qwen3 in bf16 whose linear weights are whole blocks, and its prompts."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=64, vocab_size=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device, BF16).eval()
    prompts = torch.randint(0, 512, (3, 16), generator=torch.Generator().manual_seed(1))
    return model, prompts.to(device)


def fp8_engine(model):
    """The same model with its linear layers in block FP8, zeroed: an FP8 engine before
    its first update."""
    engine = copy.deepcopy(model)
    for name, module in list(engine.named_modules()):
        if isinstance(module, torch.nn.Linear) and "_proj" in name:
            parent, _, child = name.rpartition(".")
            setattr(
                engine.get_submodule(parent), child, BlockFP8Linear(module).to(module.weight.device)
            )
    return engine


def max_relative_error(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def test_an_fp8_engine_loaded_by_a_push_gives_logits_within_a_tenth_of_bf16s():
    model, prompts = tiny_qwen3()
    engine = fp8_engine(model)
    state = model.state_dict()
    specs = specs_of(state.items())
    trainer, layout = fsdp_layout(specs, 2), EngineLayout.whole(specs, dtype=BLOCK_FP8)
    assert set(layout.param_specs(0)) == set(engine.state_dict())  # weight + weight_scale_inv
    senders = [ShardedSender(group="fp8-logits", rank=r, trainer=trainer, engine=layout)
               for r in range(2)]  # fmt: skip
    receivers = []
    try:
        receivers, _ = start_engine(
            "fp8-logits", trainer, layout, senders, False, [engine.state_dict()]
        )
        shards = [{n: state[n][slices(b)] for n, b in trainer.owned[r].items()} for r in range(2)]
        push_threads(senders, shards, 1)
        assert receivers[0].wait_for(1, WAIT)
    finally:
        for x in [*receivers, *senders]:
            x.close()
    with torch.no_grad():
        want, got = model(prompts).logits, engine(prompts).logits
    # measured: 0.079 here (7 block-FP8 matrices a layer, 2 layers of random weights); bf16
    # itself is 0.008 from float32
    assert max_relative_error(got, want) < 0.1


def test_a_region_two_replicas_take_point_to_point_is_quantized_once_a_push(monkeypatch):
    import rlferry.weights.sharded._cuts as cuts

    calls = []
    monkeypatch.setattr(cuts, "quantize_block_fp8", lambda v: calls.append(v.shape) or (
        quantize_block_fp8(v)))  # fmt: skip
    specs = layer_specs()
    trainer, engine = TrainerLayout.single(specs), EngineLayout.whole(specs, 2, BLOCK_FP8)
    sender = ShardedSender(group="fp8-replicas", rank=0, trainer=trainer, engine=engine,
                           transport="broadcast", point_to_point=True)  # fmt: skip
    receivers = []
    try:
        receivers, params = start_engine("fp8-replicas", trainer, engine, [sender], True)
        full = full_tensors(specs, 1)
        sender.push(full, version=1, timeout=WAIT)
        for r, recv in enumerate(receivers):
            assert recv.wait_for(1, WAIT)
            assert all(same_bits(params[r][n], t) for n, t in expected(engine, r, full).items())
        assert len(calls) == len([s for s in specs if "_proj" in s.name])  # once, not twice
    finally:
        for x in [*receivers, sender]:
            x.close()
