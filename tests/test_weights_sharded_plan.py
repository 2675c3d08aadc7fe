"""The sharded plan: boxes, layouts, and every needed byte mapped to exactly one owner."""

import pytest
import torch

from rlferry.weights import ShardedReceiver, ShardedSender, fsdp_layout, tp_layout
from rlferry.weights.planning import (
    EngineLayout,
    ParamLayout,
    Part,
    ShardPlan,
    TensorSpec,
    TrainerLayout,
)
from rlferry.weights.planning._boxes import cover, extents, intersect, slices, subtract, volume

F32 = torch.float32


def llama_specs(layers=2, hidden=16, inter=40, vocab=30, kv=8):
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), F32)]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "self_attn.q_proj.weight", (hidden, hidden), F32),
            TensorSpec(p + "self_attn.k_proj.weight", (kv, hidden), F32),
            TensorSpec(p + "self_attn.v_proj.weight", (kv, hidden), F32),
            TensorSpec(p + "self_attn.q_proj.bias", (hidden,), F32),
            TensorSpec(p + "self_attn.o_proj.weight", (hidden, hidden), F32),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, hidden), F32),
            TensorSpec(p + "mlp.up_proj.weight", (inter, hidden), F32),
            TensorSpec(p + "mlp.down_proj.weight", (hidden, inter), F32),
            TensorSpec(p + "input_layernorm.weight", (hidden,), F32),
        ]
    specs += [
        TensorSpec("model.norm.weight", (hidden,), F32),
        TensorSpec("lm_head.weight", (vocab, hidden), F32),
    ]
    return specs


def full_weights(specs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g).to(s.dtype) for s in specs}


def expected_params(engine, r, full):
    """What receiver ``r`` must hold: each part of each parameter cut from the full tensors."""
    out = {}
    for p in engine.receivers[r]:
        t = torch.zeros(p.shape, dtype=p.dtype)
        for q in p.parts:
            t[slices(q.at)] = full[q.source][slices(q.box)].to(p.dtype).reshape(extents(q.at))
        out[p.name] = t
    return out


def apply_plan(plan, full):
    """Run the plan's copies by hand: each sender's pieces cut from what it owns, each
    receiver filled from the pieces; counts how many times each needed element is written."""
    engine = plan.engine
    got = []
    for r in range(len(engine.receivers)):
        params = {p.name: torch.zeros(p.shape, dtype=p.dtype) for p in engine.receivers[r]}
        hits = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in params.items()}
        for s in plan.senders_of(r):
            owned = plan.trainer.owned[s]
            for c in plan.copies[(s, r)]:
                piece = plan.piece(s, c.piece)
                assert intersect(piece.box, owned[piece.source]) == piece.box or not piece.box
                data = full[piece.source][slices(piece.box)].to(piece.dtype)
                dst = params[c.param][slices(c.at)]
                dst.copy_(data[slices(c.within)].reshape(dst.shape))
                hits[c.param][slices(c.at)] += 1
        got.append((params, hits))
    return got


@pytest.mark.parametrize(
    ("ranks", "tp", "replicas"), [(1, 1, 1), (4, 1, 2), (2, 2, 1), (3, 2, 2), (4, 4, 1)]
)
def test_every_needed_byte_arrives_exactly_once_from_its_one_owner(ranks, tp, replicas):
    specs = llama_specs()
    trainer, engine = fsdp_layout(specs, ranks), tp_layout(specs, tp, replicas=replicas)
    plan = ShardPlan.build(trainer, engine)
    full = full_weights(specs)
    for r, (params, hits) in enumerate(apply_plan(plan, full)):
        want = expected_params(engine, r, full)
        assert params.keys() == want.keys()
        for n in params:
            assert torch.equal(params[n], want[n]), n
            assert int(hits[n].max()) == 1 and int(hits[n].min()) == 1, n  # once, every element
    total = sum(s.nbytes for s in specs)
    sent = [plan.stream_bytes(s) for s in range(ranks)]
    assert sum(sent) == total  # each byte once, however many replicas need it
    for s in range(ranks):  # a sender sends only what it owns
        assert plan.stream_bytes(s) <= trainer.owned_bytes(s)


def test_one_sender_one_receiver_is_todays_push_whole_tensors_under_their_own_names():
    specs = llama_specs()
    plan = ShardPlan.build(TrainerLayout.single(specs), EngineLayout.whole(specs))
    assert plan.stream_specs(0) == specs
    assert list(plan.copies) == [(0, 0)]
    assert plan.senders_of(0) == [0] and plan.receivers_of(0) == [0]


def test_a_ranks_busiest_link_comes_first():
    # FSDP2 shards rows as a TP=2 engine splits its column-parallel tensors: trainer rank
    # r owns most of what engine rank r needs (rank 1's busiest link is its second rank's)
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    plan = ShardPlan.build(fsdp_layout(specs, 2), tp_layout(specs, 2))
    for s in (0, 1):
        order = plan.busiest_first(s)
        assert sorted(order) == plan.receivers_of(s) == [0, 1]
        assert order[0] == s and plan.link_bytes(s, s) > plan.link_bytes(s, 1 - s)
    one = ShardPlan.build(fsdp_layout(specs, 1), tp_layout(specs, 2))  # equal links: by rank
    assert one.link_bytes(0, 0) == one.link_bytes(0, 1) and one.busiest_first(0) == [0, 1]


def test_a_tp2_engine_gets_fused_qkv_and_gate_up_slices_in_vllm_order():
    specs = llama_specs(layers=1, hidden=16, inter=40, kv=8)
    engine = tp_layout(specs, 2)
    p = {x.name: x for x in engine.receivers[1]}
    qkv = p["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (8 + 4 + 4, 16)
    assert [(q.source.split(".")[-2], q.box, q.at) for q in qkv.parts] == [
        ("q_proj", ((8, 16), (0, 16)), ((0, 8), (0, 16))),
        ("k_proj", ((4, 8), (0, 16)), ((8, 12), (0, 16))),
        ("v_proj", ((4, 8), (0, 16)), ((12, 16), (0, 16))),
    ]
    gate_up = p["model.layers.0.mlp.gate_up_proj.weight"]
    assert gate_up.shape == (40, 16)
    assert [q.at for q in gate_up.parts] == [((0, 20), (0, 16)), ((20, 40), (0, 16))]
    assert p["model.layers.0.self_attn.o_proj.weight"].parts[0].box == ((0, 16), (8, 16))
    assert p["model.layers.0.mlp.down_proj.weight"].shape == (16, 20)
    assert p["model.norm.weight"].parts[0].box == ((0, 16),)  # replicated: whole
    assert p["model.layers.0.self_attn.qkv_proj.bias"].shape == (8,)  # q bias only here


def test_fused_experts_go_to_w13_and_w2_and_narrow_to_the_engine_dtype_on_the_wire():
    specs = [
        TensorSpec("model.layers.0.mlp.experts.gate_up_proj", (4, 12, 8), F32),
        TensorSpec("model.layers.0.mlp.experts.down_proj", (4, 8, 6), F32),
    ]
    engine = tp_layout(specs, 2, dtype=torch.bfloat16)
    w13 = {x.name: x for x in engine.receivers[0]}["model.layers.0.mlp.experts.w13_weight"]
    assert w13.shape == (4, 6, 8) and w13.dtype == torch.bfloat16
    assert [q.box for q in w13.parts] == [((0, 4), (0, 3), (0, 8)), ((0, 4), (6, 9), (0, 8))]
    plan = ShardPlan.build(fsdp_layout(specs, 2), engine)
    assert {p.dtype for s in range(2) for p in plan.streams[s]} == {torch.bfloat16}
    assert sum(plan.stream_bytes(s) for s in range(2)) == sum(s.nbytes for s in specs) // 2
    full = full_weights(specs)
    for r, (params, _) in enumerate(apply_plan(plan, full)):
        want = expected_params(engine, r, full)
        assert all(torch.equal(params[n], want[n]) for n in want)


def test_boxes_subtract_and_cover_without_overlap():
    a, b = ((0, 10), (0, 10)), ((3, 5), (4, 12))
    parts = subtract(a, b)
    assert sum(volume(p) for p in parts) == volume(a) - volume(intersect(a, b))
    assert all(intersect(p, b) is None for p in parts)
    boxes = [((0, 5), (0, 8)), ((0, 5), (0, 8)), ((3, 9), (2, 6)), ((7, 9), (0, 8))]
    c = cover(boxes)
    assert all(intersect(x, y) is None for i, x in enumerate(c) for y in c[i + 1 :])
    grid = torch.zeros(10, 10, dtype=torch.int32)
    for x in c:
        grid[slices(x)] += 1
    want = torch.zeros(10, 10, dtype=torch.int32)
    for x in boxes:
        want[slices(x)] = 1
    assert torch.equal(grid, want)


def test_a_layout_change_recomputes_the_plan_and_the_same_layouts_do_not():
    specs = llama_specs(layers=1)
    trainer, engine = fsdp_layout(specs, 1), tp_layout(specs, 1)
    with ShardedSender(group="p", rank=0, trainer=trainer, engine=engine) as s:
        for _ in range(3):
            s.plan()
        assert s.statistics().plans_computed == 1
        s.set_layouts(engine=tp_layout(specs, 1))  # equal layouts, same fingerprint
        s.plan()
        assert s.statistics().plans_computed == 1
        s.set_layouts(engine=tp_layout(specs, 1, dtype=torch.bfloat16))
        assert s.plan().streams[0][0].dtype == torch.bfloat16
        assert s.statistics().plans_computed == 2


def test_a_needed_byte_nobody_owns_is_named():
    specs = [TensorSpec("w", (8, 4), F32)]
    trainer = TrainerLayout(tuple(specs), ({"w": ((0, 4), (0, 4))}, {"w": ((5, 8), (0, 4))}))
    with pytest.raises(ValueError) as e:
        ShardPlan.build(trainer, EngineLayout.whole(specs))
    assert str(e.value) == (
        "tensor `w` [0:8, 0:4], needed by receiver 0 for `w`: expected every element owned by "
        "a trainer rank, got 4 of 32 owned by none (the trainer layout must cover every tensor "
        "the engine needs)"
    )


def test_a_byte_owned_twice_is_named_with_both_ranks():
    specs = [TensorSpec("w", (8, 4), F32)]
    trainer = TrainerLayout(tuple(specs), ({"w": ((0, 5), (0, 4))}, {"w": ((4, 8), (0, 4))}))
    with pytest.raises(ValueError) as e:
        ShardPlan.build(trainer, EngineLayout.whole(specs))
    assert str(e.value) == (
        "tensor `w` [0:8, 0:4], needed by receiver 0 for `w`: expected each element owned by "
        "one trainer rank, got overlapping boxes of ranks [0, 1] (own a replicated tensor on "
        "one rank only)"
    )


def test_bad_boxes_and_parts_are_refused_naming_the_field():
    specs = (TensorSpec("w", (8, 4), F32),)
    with pytest.raises(ValueError) as e:
        TrainerLayout(specs, ({"w": ((0, 9), (0, 4))},))
    assert str(e.value) == (
        "TrainerLayout.owned[0]['w']: expected one (start, stop) per dimension of shape [8, 4] "
        "with 0 <= start <= stop <= size, got [0:9, 0:4] (a region outside the tensor, or of "
        "another rank)"
    )
    with pytest.raises(ValueError) as e:
        TrainerLayout(specs, ({"x": ((0, 8), (0, 4))},))
    assert "TrainerLayout.owned[0]['x']: expected a tensor of specs, got an unknown name" in str(
        e.value
    )
    bad = ParamLayout("p", (4, 4), F32, (Part("w", ((0, 4), (0, 4)), ((0, 4), (0, 2))),))
    with pytest.raises(ValueError) as e:
        EngineLayout(specs, ((bad,),))
    assert str(e.value) == (
        "EngineLayout.receivers[0]['p'].parts[0]: expected `at` of the extents of `box` [4, 4], "
        "got [4, 2] (a part is copied as it is, never reshaped)"
    )
    first = Part("w", ((0, 4), (0, 4)), ((0, 4), (0, 4)))
    twice = ParamLayout("p", (4, 4), F32, (first, Part("w", ((4, 6), (0, 4)), ((2, 4), (0, 4)))))
    with pytest.raises(ValueError) as e:
        EngineLayout(specs, ((twice,),))
    assert "parts[1].at: expected parts that do not overlap, got [2:4, 0:4] over parts[0]" in str(
        e.value
    )
    with pytest.raises(ValueError) as e:
        fsdp_layout(specs, 0)
    assert str(e.value) == "fsdp_layout.ranks: expected an int >= 1, got 0"


def test_a_receiver_refuses_params_that_are_not_its_layouts():
    specs = llama_specs(layers=1)
    trainer, engine = fsdp_layout(specs, 2), tp_layout(specs, 2)
    params = {p.name: torch.zeros(p.shape, dtype=p.dtype) for p in engine.receivers[0]}
    params["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError) as e:
        ShardedReceiver(
            group="g", rank=0, trainer=trainer, engine=engine, params=params, addresses=["a", "b"]
        )
    assert str(e.value) == (
        "ShardedReceiver.params['model.norm.weight']: expected shape [16] float32 (engine rank 0 "
        "of the engine layout), got shape [3] torch.float32 (give this rank's tensors, made "
        "from EngineLayout.param_specs)"
    )


def test_a_receiver_whose_trainer_rank_is_not_there_fails_to_start_and_holds_no_link(tmp_path):
    from rlferry.weights import SenderGone

    specs = llama_specs(layers=1)
    trainer, engine = fsdp_layout(specs, 2), tp_layout(specs, 1)
    with ShardedSender(group="g", rank=0, trainer=trainer, engine=engine) as s:
        params = {p.name: torch.zeros(p.shape) for p in engine.receivers[0]}
        r = ShardedReceiver(
            group="g", rank=0, trainer=trainer, engine=engine, params=params,
            addresses=[s.address, f"ipc://{tmp_path}/nobody"],
        )  # fmt: skip
        with pytest.raises(SenderGone) as e:
            r.start(timeout=5)
        assert f"cannot reach the sender at ipc://{tmp_path}/nobody" in str(e.value)
        assert r.statistics().links == {}  # rank 0's link was left again
        r.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_an_engine_ranks_offer_puts_every_region_of_its_links_pieces_in_its_place(rank):
    """What a ShardedReceiver offers a cuda_ipc sender to write into (the GPU test writes
    across GPUs): for each piece of each trainer rank's link, regions of it and views of
    the rank's own tensors; copying the regions there makes the rank's tensors whole."""
    from rlferry.weights import ShardedReceiver
    from rlferry.weights.planning._buckets import Plan
    from rlferry.weights.sharded._links import Link

    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    trainer, engine = fsdp_layout(specs, 2), tp_layout(specs, 2)
    plan = ShardPlan.build(trainer, engine)
    params = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in engine.param_specs(rank).items()}
    r = ShardedReceiver(
        group="g", rank=rank, trainer=trainer, engine=engine, params=params,
        addresses=["ipc:///nowhere-0", "ipc:///nowhere-1"], point_to_point=True,
    )  # fmt: skip
    full = full_weights(specs, 1)
    for s in plan.senders_of(rank):
        pieces = plan.link(s, rank)[0]
        link_plan = Plan.build([p.spec() for p in pieces], 1 << 20)  # what the link pushes
        targets = r._targets_for(Link(s, ""), link_plan)
        assert targets is not None and len(targets) == len(pieces)
        for piece, entry in zip(pieces, targets, strict=True):
            value = full[piece.source][slices(piece.box)].to(piece.dtype)
            for region, dst in entry:
                assert dst.untyped_storage().data_ptr() in {
                    t.untyped_storage().data_ptr() for t in params.values()
                }  # a view of the rank's own tensors, not a copy
                dst.copy_(value[region])
    want = expected_params(engine, rank, full)
    assert all(torch.equal(params[n], want[n]) for n in want)
