"""`rlferry plan-weights`: a transformers model on the meta device, planned and timed."""

import json
import subprocess
import sys

import pytest
import torch

from rlferry.errors import RequestError
from rlferry.weights import fsdp_layout, tp_layout
from rlferry.weights.planning import Cluster, ShardPlan, TensorSpec, plan_weights, predict
from rlferry.weights.planning._budget import (
    NCCL_CTA_BYTES,
    NCCL_LINK_BYTES,
    NCCL_PEER_BYTES,
    NCCL_PROCESS_BYTES,
)
from rlferry.weights.planning._plan_weights import model_specs
from rlferry.weights.planning._predict import (
    BUCKET_MS,
    LINK_MS,
    UPDATE_MS,
    representatives,
    trainer_layout,
)
from rlferry.weights.planning._savings import delta_bytes, lora_specs, predict_delta

pytest.importorskip("transformers")

TINY = {
    "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
}  # fmt: skip
FP8 = torch.float8_e4m3fn


def tiny_specs():
    return model_specs("Qwen3Config", TINY)


def test_identical_layers_are_planned_once_and_counted_as_many_times():
    specs = tiny_specs()
    reps, count = representatives(specs)
    assert len(reps) == len(specs) - 3 * (len(specs) - 3) // 4  # one layer of four, plus 3
    assert count["model.layers.0.mlp.up_proj.weight"] == 4 and count["lm_head.weight"] == 1


def test_the_prediction_counts_every_link_of_the_full_plan():
    specs = tiny_specs()
    p = predict(specs, Cluster(fsdp=4, engines=2, engine_tp=2))
    full = ShardPlan.build(fsdp_layout(specs, 4), tp_layout(specs, 2, replicas=2, dtype=FP8))
    links = {k: full.link_bytes(*k) for k in full.copies}
    assert p.sent_bytes == sum(links.values())
    assert p.links == len(links)
    assert p.receiver_bytes == tuple(
        sum(b for (_, r), b in links.items() if r == k) for k in range(4)
    )
    # 8 GPUs on one host: every link is NVLink; the busiest GPU sets the time
    busiest = max(*p.sender_bytes, *p.receiver_bytes)
    assert p.busiest_bytes == busiest
    assert p.link_seconds == pytest.approx(busiest / 450e9)
    # every trainer rank sends to each of the 4 engine ranks, each engine rank hears from 4
    assert p.trainer_links == max(sum(1 for s, _ in links if s == k) for k in range(4)) == 4
    assert p.engine_links == max(sum(1 for _, r in links if r == k) for k in range(4)) == 4
    # an update's cost, and each more link's at either end; the tiny links take a bucket each
    fixed = UPDATE_MS + LINK_MS * (4 - 1 + 4 - 1)
    assert p.buckets == 4 and p.bucket_seconds == 0.0
    assert p.seconds == pytest.approx(busiest / 450e9 + fixed / 1e3)
    assert "over nvlink" in p.busiest


def test_engines_on_other_hosts_are_reached_over_the_network():
    specs = tiny_specs()
    p = predict(specs, Cluster(fsdp=8, engines=2, engine_tp=4, network_GBps=50.0))
    assert "over network" in p.busiest
    fixed = UPDATE_MS + LINK_MS * (p.trainer_links - 1 + p.engine_links - 1)
    assert p.seconds == pytest.approx(p.busiest_bytes / 50e9 + fixed / 1e3)


def test_trainer_tensor_parallelism_inside_fsdp_still_owns_every_byte_once():
    specs = tiny_specs()
    trainer = trainer_layout(specs, fsdp=2, tp=2)
    plan = ShardPlan.build(trainer, tp_layout(specs, 2))
    assert sum(plan.stream_bytes(s) for s in range(4)) == sum(s.nbytes for s in specs)
    q = "model.layers.0.self_attn.q_proj.weight"  # TP splits rows, FSDP chunks each slice
    assert [trainer.owned[r][q][0] for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    o = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: TP splits columns
    assert trainer.owned[2][o] == ((0, 32), (32, 64))


@pytest.mark.slow
def test_the_command_prints_links_the_busiest_and_the_time(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3", **TINY}))
    args = ["--trainer-gpus", "4", "--engines", "2", "--engine-tp", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "rlferry.cli", "plan-weights", "--config", str(cfg), *args],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    p = predict(tiny_specs(), Cluster(fsdp=4, engines=2, engine_tp=2))
    lines = out.splitlines()
    assert lines[0].startswith(f"{cfg}: {len(tiny_specs())} tensors; trainer 4 GPUs (FSDP 4 x TP")
    fixed = UPDATE_MS + LINK_MS * (p.trainer_links - 1 + p.engine_links - 1)
    assert lines[-1] == (
        f"predicted update time: {p.seconds * 1e3:.1f} ms (the busiest link, {fixed:.1f} ms "
        f"for up to 4 links a trainer rank and 4 an engine rank, 0.0 ms for the buckets)"
    )
    # NCCL's own, and 4 links a rank, each at NCCL's choice of blocks, to GPUs of the host
    assert p.nccl_bytes == NCCL_PROCESS_BYTES + 4 * (NCCL_LINK_BYTES + NCCL_PEER_BYTES)
    assert lines[-2] == (
        f"buffers: at most {p.buffer_bytes / 1e3:.2f} kB a rank; NCCL's own for its links: "
        f"about {p.nccl_bytes / 1e9:.2f} GB a rank; buckets: at most 4 a rank an update"
    )
    assert lines[-3].startswith(f"busiest link: {p.busiest}")
    assert any(line.startswith("sent: ") and f"over {p.links} links" in line for line in lines)


@pytest.mark.parametrize(
    "given, refusal",
    [
        (["--config", "NoSuchConfig"],
         "config: expected a config.json path, a transformers configuration class name such "
         "as Qwen3MoeConfig or a preset (qwen3-235b-a22b, kimi-k2), got 'NoSuchConfig'"),
        (["--config", "kimi-k2", "--buffer-gib", "0.001"],
         "--buffer-gib: expected at least 0.00390625 (two buffers of the smallest bucket, "
         "2 MiB), got 0.001"),
    ],
)  # fmt: skip
def test_a_wrong_argument_is_refused_by_name(given, refusal):
    out = subprocess.run(
        [sys.executable, "-m", "rlferry.cli", "plan-weights", *given,
         "--trainer-gpus", "4", "--engines", "1", "--engine-tp", "2"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip() == f"rlferry plan-weights: {refusal}"


def test_an_update_costs_its_bytes_and_what_is_told_besides_them():
    p = predict(tiny_specs(), Cluster(fsdp=4, engines=2, engine_tp=2, update_ms=0.0, link_ms=0.0))
    assert p.seconds == p.link_seconds == pytest.approx(p.busiest_bytes / 450e9)
    one = predict(tiny_specs(), Cluster(fsdp=1, engines=1, engine_tp=1, link_ms=7.0))
    assert one.trainer_links == one.engine_links == 1  # the further-link cost does not apply
    assert one.seconds == pytest.approx(one.link_seconds + UPDATE_MS / 1e3)
    for field in ("update_ms", "link_ms", "bucket_ms"):
        with pytest.raises(ValueError) as e:
            Cluster(fsdp=4, engines=2, engine_tp=2, **{field: -1.0})
        assert str(e.value) == f"Cluster.{field}: expected a time >= 0, got -1.0"


def test_many_links_a_rank_share_its_buffers_in_more_smaller_buckets_which_cost_time():
    # row-parallel weights: every trainer rank owns rows, every TP rank needs columns
    specs = [
        TensorSpec(f"model.layers.{i}.mlp.down_proj.weight", (4096, 4096), torch.bfloat16)
        for i in range(64)
    ]
    kw = {"fsdp": 8, "engines": 1, "engine_tp": 8, "engine_dtype": torch.bfloat16}
    roomy = predict(specs, Cluster(**kw, buffer_bytes=64 << 30))
    tight = predict(specs, Cluster(**kw, buffer_bytes=64 << 20))
    # 8 links a rank at either end, 32 MiB each (512 x 512 of 64 tensors): in a roomy
    # budget a bucket a link; 64 MiB for 8 links makes 4 MiB buckets, 8 a link
    assert roomy.trainer_links == roomy.engine_links == 8
    assert roomy.link_bytes == (32 << 20,) * 3
    assert roomy.buckets == 8 and roomy.bucket_seconds == 0.0
    assert tight.buckets == 64
    assert tight.bucket_seconds == pytest.approx(56 * BUCKET_MS / 1e3)
    assert tight.buffer_bytes == 8 * 2 * (4 << 20) == 64 << 20
    assert roomy.buffer_bytes == 8 * 2 * (32 << 20)
    assert tight.seconds - roomy.seconds == pytest.approx(56 * BUCKET_MS / 1e3)
    # NCCL's memory does not depend on the buffers: 8 links a rank, NCCL's own blocks;
    # at 16 links a rank they share 32 blocks, 2 a link
    # (the trainer's host is not the engine's: no GPU of a rank's host is reached)
    assert roomy.nccl_bytes == tight.nccl_bytes == NCCL_PROCESS_BYTES + 8 * NCCL_LINK_BYTES
    many = predict(specs, Cluster(fsdp=16, engines=1, engine_tp=16, engine_dtype=torch.bfloat16))
    assert many.trainer_links == many.engine_links == 16
    assert many.nccl_bytes == NCCL_PROCESS_BYTES + 16 * 2 * NCCL_CTA_BYTES
    with pytest.raises(ValueError) as e:
        Cluster(**kw, buffer_bytes=2 << 20)
    assert str(e.value) == (
        "Cluster.buffer_bytes: expected an int of at least 4194304 (two buffers of the "
        "smallest bucket), got 2097152"
    )


BLOCKS = {**TINY, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64,
          "num_key_value_heads": 4}  # fmt: skip  # every linear weight whole blocks, 2 ranks too


def test_block_fp8_sends_a_byte_an_element_and_four_a_block_and_times_the_quantize_pass():
    specs = model_specs("Qwen3Config", BLOCKS)
    c = Cluster(fsdp=2, engines=2, engine_tp=1, engine_dtype="fp8_block128", quantize_GBps=1.0)
    p = predict(specs, c)
    plan = ShardPlan.build(fsdp_layout(specs, 2), tp_layout(specs, 1, replicas=2,
                                                                 dtype="fp8_block128"))  # fmt: skip
    assert p.sent_bytes == sum(plan.link_bytes(*k) for k in plan.copies)
    linear = [s for s in specs if s.name.endswith("_proj.weight")]
    fp8 = sum(s.nbytes // 2 + 4 * (s.nbytes // 2 // 128**2) for s in linear)  # whole blocks
    rest = sum(s.nbytes for s in specs if s not in linear)
    assert p.sent_bytes == 2 * (fp8 + rest)  # each engine's copy
    assert p.quantize_bytes == sum(s.nbytes for s in linear) // 2  # each rank: half the rows
    assert p.quantize_seconds == pytest.approx(p.quantize_bytes / 1e9)
    bare = predict(specs, Cluster(fsdp=2, engines=2, engine_tp=1, quantize_GBps=1.0))
    assert bare.quantize_bytes == 0 and bare.quantize_seconds == 0.0
    assert p.seconds == pytest.approx(
        p.link_seconds + p.fixed_seconds + p.bucket_seconds + p.quantize_seconds
    )
    assert f"to block FP8 in {p.quantize_seconds * 1e3:.1f} ms" in p.text()


def test_plan_weights_names_a_trainer_layout_that_cuts_blocks():
    from rlferry.weights.planning import BlockFP8Error, plan_weights

    sizes = [f"{k}={v}" for k, v in BLOCKS.items()]
    text = plan_weights("Qwen3Config", sizes, trainer_gpus=1, engines=1, engine_tp=1,
                        engine_dtype="fp8_block128", quantize_gbytes=500.0)  # fmt: skip
    assert text.splitlines()[0].endswith("; block FP8 quantized at 500 GB/s a trainer rank")
    with pytest.raises(BlockFP8Error, match=r"trainer rank 0 owns \[0:32, 0:256\] of it, which "
                       r"cuts 128 x 128 blocks"):  # fmt: skip
        plan_weights("Qwen3Config", sizes, trainer_gpus=8, engines=1, engine_tp=1,
                     engine_dtype="fp8_block128")  # fmt: skip


def test_a_delta_sends_offsets_and_values_of_what_changed_or_the_tensor_whole():
    bf16 = torch.bfloat16
    assert delta_bytes(1 << 20, bf16, 0.0) == 0  # nothing changed: nothing sent
    # 1% of 2^20 elements: 10,486 changes of 2 + 1 bytes, 4,096 blocks of 2 bytes of count
    assert delta_bytes(1 << 20, bf16, 0.01) == 4096 * 2 + 10486 * 3
    # 60% changed: sparse would save less than 10% of the tensor, so it goes whole
    assert delta_bytes(1 << 20, bf16, 0.6) == (1 << 20) * 2
    # fp8 engines: 2 bytes a change against 1 an element
    assert delta_bytes(1 << 20, torch.float8_e4m3fn, 0.3) == 4096 * 2 + 314573 * 2
    assert delta_bytes(1 << 20, torch.float8_e4m3fn, 0.45) == 1 << 20


def test_a_delta_push_is_planned_on_the_same_links_with_fewer_bytes_and_a_diff():
    specs, c = tiny_specs(), Cluster(fsdp=4, engines=2, engine_tp=2, engine_dtype=torch.bfloat16)
    full = predict(specs, c)
    everything = predict_delta(specs, c, 1.0)
    assert everything.delta.sent_bytes == full.sent_bytes  # all changed: the dense fallback
    nothing = predict_delta(specs, c, 0.0, diff_GBps=100.0)
    assert nothing.delta.sent_bytes == 0
    assert nothing.diff_seconds == pytest.approx(max(full.sender_bytes) / 100e9)
    some = predict_delta(specs, c, 0.01)
    assert 0 < some.delta.sent_bytes < 0.05 * full.sent_bytes
    assert some.seconds == pytest.approx(some.diff_seconds + some.delta.seconds)
    assert some.delta.links == full.links


def test_a_lora_adapter_has_a_and_b_for_every_linear_of_attention_and_mlp():
    specs = tiny_specs()
    adapter = {s.name: s.shape for s in lora_specs(specs, 4, torch.bfloat16)}
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert adapter[f"{q}.lora_A.weight"] == (4, 64)  # rank x in
    assert adapter[f"{q}.lora_B.weight"] == (64, 4)  # out x rank
    assert len(adapter) == 2 * 7 * 4  # q k v o gate up down, 4 layers; no head, no norm
    with pytest.raises(RequestError, match=r"^lora rank: expected an int >= 1, got 0$"):
        lora_specs(specs, 0, torch.bfloat16)


def test_the_command_predicts_a_delta_push_and_a_lora_adapter_beside_the_full_push(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3", **TINY}))
    out = plan_weights(
        str(cfg), trainer_gpus=4, engines=2, engine_tp=2, changed=0.02, lora_rank=4
    ).splitlines()
    assert out[-2].startswith("delta push, 2.00% of the elements changed: sent ")
    assert out[-1].startswith("LoRA rank 4 (every linear of the attention and the MLP, 28 ")
