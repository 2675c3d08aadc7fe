"""FSDP2 shards gathered a bucket at a time equal DTensor's own gather, bit for bit."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run

transformers = pytest.importorskip("transformers", reason="needs transformers (the [demo] extra)")


def _rank(rank: int, store: str, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rlferry.rl.trainer._gather import gathered

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(  # 13 ids: the embedding's rows split 7 + 6
            vocab_size=13, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=48, tie_word_embeddings=False,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
        mesh = init_device_mesh("cpu", (2,))  # not CUDA's, if one is seen
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        want = [(n, t.full_tensor()) for n, t in model.state_dict().items()]
        for bucket_bytes in (1, 3000, 1 << 30):  # a tensor per bucket, some, all in one
            got = list(gathered(model, torch.float32, bucket_bytes=bucket_bytes))
            assert [n for n, _ in got] == [n for n, _ in want]
            for (n, g), (_, w) in zip(got, want, strict=True):
                assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w), n
        half = list(gathered(model, torch.bfloat16))
        assert all(t.dtype == torch.bfloat16 for _, t in half)
        for (_, h), (_, w) in zip(half, want, strict=True):
            assert torch.equal(h, w.to(torch.bfloat16))
        out[rank] = "ok"
    except BaseException as e:
        out[rank] = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()


def test_bucketed_gathers_equal_full_tensor_for_uneven_shards_and_any_bucket_size(tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path / "group"), out), nprocs=2, join=True)
        assert dict(out) == {0: "ok", 1: "ok"}
