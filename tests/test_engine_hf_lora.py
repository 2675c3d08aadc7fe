"""HFEngine serving base + a LoRA adapter pushed through a real WeightSender (shm).

The adapter is applied in the engine's forward, the base weights untouched: in float32 its
greedy tokens equal those of a model whose weights are the adapter merged in float32
(``W + scaling B A``), and its logprobs agree within 1e-5 (the two round differently). A
push that does not fit the engine's adapter slots is refused before any byte moves, and
the engine keeps serving its version and its adapter.
"""

import asyncio

import pytest
import torch

from conftest import requires_cuda
from rlferry.errors import RequestError
from rlferry.weights import WeightSender, WeightSyncError, fingerprint

pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
from rlferry.engines.hf import HFEngine
from rlferry.engines.lora import (
    CONFIG_NAME,
    LoraConfig,
    LoraLayers,
    LoraMismatch,
    config_tensor,
    lora_names,
    peft_adapter,
)
from test_engine_hf import tiny_model
from test_engine_hf_weights import req

CONFIG = LoraConfig(rank=4, alpha=8.0)
TOLERANCE = 1e-5  # logprobs: applied in the forward against merged, both in float32


def adapter(seed, config=CONFIG, model=None):
    """A trained-looking adapter of ``config`` for the tiny model: (LoraLayers, its pairs)."""
    layers = LoraLayers(model or tiny_model(0), config, trainable=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a, b in layers.modules.values():
            a.copy_(torch.randn(a.shape, generator=g) * 0.3)
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return layers, layers.named()


def merged(layers, scaling=CONFIG.scaling):
    """The tiny model with ``layers``' adapter merged into its weights in float32."""
    model = tiny_model(0)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, (a, b) in layers.modules.items():
            modules[name].weight += scaling * (b @ a)
    return model


async def joined(group, config=CONFIG, **kw):
    engine = HFEngine(tiny_model(0), name="e", lora=config, **kw)
    sender = WeightSender(group=group, transport="shm")
    await engine.init_weight_transfer(group, sender.address)
    return engine, sender


async def push(sender, named, version):
    return await asyncio.to_thread(sender.push, named, version=version, timeout=30)


async def greedy(engine, rid="r", n=12):
    return await engine.generate(req(rid, n))


async def served_by(model):
    with HFEngine(model, kv_cache="dynamic") as engine:
        return await greedy(engine)


def same(engine, named):
    held = engine.adapter.tensors()
    return all(torch.equal(held[n], t) for n, t in named)


@pytest.mark.parametrize("kv", ["dynamic", "slots"])
def test_base_plus_adapter_generates_as_the_weights_merged_in_float32(kv):
    layers, named = adapter(1)

    async def main():
        engine, sender = await joined("merged", kv_cache=kv)
        with engine, sender:
            before = await greedy(engine, "before")
            await push(sender, named, 1)
            after = await greedy(engine, "after")
            held = same(engine, named)
        return before, after, held, await served_by(merged(layers)), await served_by(tiny_model(0))

    before, after, held, want, base = asyncio.run(main())
    assert held  # the engine's adapter is the trainer's, bit for bit
    # no adapter before the first push: the base model's tokens (the slot cache and the
    # dynamic one round alike on this CPU, not on every one)
    assert before.token_ids == base.token_ids
    assert before.logprobs == pytest.approx(base.logprobs, abs=TOLERANCE)
    assert after.token_ids == want.token_ids != base.token_ids
    assert after.logprobs == pytest.approx(want.logprobs, abs=TOLERANCE)
    assert after.versions == [1] * 12


def test_a_second_adapter_replaces_the_first():
    first, named1 = adapter(1)
    second, named2 = adapter(2)

    async def main():
        engine, sender = await joined("second")
        with engine, sender:
            await push(sender, named1, 1)
            one = await greedy(engine, "one")
            await push(sender, named2, 2)
            two = await greedy(engine, "two")
            held = same(engine, named2)
        return one, two, held, await served_by(merged(first)), await served_by(merged(second))

    one, two, held, want1, want2 = asyncio.run(main())
    assert held and one.token_ids == want1.token_ids and two.token_ids == want2.token_ids
    assert one.token_ids != two.token_ids
    assert two.logprobs == pytest.approx(want2.logprobs, abs=TOLERANCE)
    assert two.versions == [2] * 12


def test_the_alpha_of_each_push_scales_its_adapter():
    layers, named = adapter(1)
    doubled = [(n, config_tensor(4, 16.0) if n == CONFIG_NAME else t) for n, t in named]

    async def main():
        engine, sender = await joined("alpha")
        with engine, sender:
            await push(sender, doubled, 1)
            return await greedy(engine), await served_by(merged(layers, scaling=4.0))

    got, want = asyncio.run(main())
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=TOLERANCE)


def test_an_adapter_of_fewer_modules_is_served_whole_the_others_without_one():
    """The second push names the attention's modules only: the MLP's slots that the first
    adapter filled serve no adapter (an adapter is served as pushed, whatever came before)."""
    _, full = adapter(1)
    attention = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj"))
    layers, named = adapter(2, attention)

    async def main():
        engine, sender = await joined("fewer")
        with engine, sender:
            await push(sender, full, 1)
            await push(sender, named, 2)
            mlp = [t for n, t in engine.adapter.tensors().items() if ".mlp." in n]
            return await greedy(engine), mlp, same(engine, named)

    got, mlp, held = asyncio.run(main())
    assert held and mlp and all(not t.any() for t in mlp)
    want = asyncio.run(served_by(merged(layers)))
    assert got.token_ids == want.token_ids


def test_the_fingerprint_covers_the_base_then_the_adapter():
    _, named = adapter(1)

    async def main():
        engine, sender = await joined("digest")
        with engine, sender:
            await push(sender, named, 1)
            return await engine.fingerprint()

    base = list(tiny_model(0).state_dict().items())
    assert asyncio.run(main()) == fingerprint(base + named)


def refused(named, group):
    """Push ``named`` to an engine serving adapter 1 at version 1: the receiver's reason, and
    what the engine serves after (version, adapter 1 still held, not paused)."""
    _, first = adapter(1)

    async def main():
        engine, sender = await joined(group)
        with engine, sender:
            await push(sender, first, 1)
            with pytest.raises(WeightSyncError) as e:
                await push(sender, named, 2)
            done = await greedy(engine)
            return (
                e.value.failures["e"],
                done.versions,
                same(engine, first),
                (await engine.is_paused()),
            )

    return asyncio.run(main())


def test_an_adapter_for_modules_the_engine_lacks_is_refused_before_any_byte_moves():
    attention = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    engine_of = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj",))

    async def main():
        engine, sender = await joined("lacks", engine_of)
        with engine, sender:
            with pytest.raises(WeightSyncError) as e:
                await push(sender, adapter(1, attention)[1], 1)
            return e.value.failures["e"], (await greedy(engine)).versions

    error, versions = asyncio.run(main())
    assert error == (
        "rejected the plan: the receiver's check raised LoraMismatch: adapter: expected "
        "modules of the engine's adapter slots (target_modules ['q_proj']), got 2 it lacks: "
        "`model.layers.0.self_attn.v_proj`, `model.layers.1.self_attn.v_proj` (start the "
        "engine with LoraConfig(target_modules=...) naming them)"
    )
    assert versions == [0] * 12


def test_an_adapter_of_another_rank_is_refused_and_the_engine_keeps_its_adapter():
    error, versions, held, paused = refused(adapter(2, LoraConfig(rank=8, alpha=8.0))[1], "rank")
    a = lora_names("model.layers.0.self_attn.q_proj")[0]
    assert error == (
        "rejected the plan: the receiver's check raised LoraMismatch: adapter: expected rank "
        f"4 (the engine's adapter slots), got rank 8 (`{a}` shape [8, 64] float32); start the "
        "engine with LoraConfig(rank=8) to serve it"
    )
    assert versions == [1] * 12 and held and not paused


def test_an_adapter_whose_shape_or_dtype_does_not_fit_is_refused():
    _, named = adapter(2)
    a, b = lora_names("model.layers.0.mlp.down_proj")
    wrong = [(n, torch.zeros(4, 65) if n == a else t.double() if n == b else t) for n, t in named]
    error, versions, held, paused = refused(wrong, "shape")
    assert error == (
        "rejected the plan: the receiver's check raised LoraMismatch: adapter: 2 of its "
        f"tensors do not fit the engine's adapter slots (rank 4): `{a}`: expected shape "
        f"[4, 128] float32, got shape [4, 65] float32; `{b}`: expected shape [64, 4] "
        "float32, got shape [64, 4] float64"
    )
    assert versions == [1] * 12 and held and not paused


def test_an_adapter_without_its_config_or_half_a_module_is_refused():
    _, named = adapter(2)
    b = lora_names("model.layers.1.self_attn.o_proj")[1]
    error, versions, held, _ = refused(
        [(n, t) for n, t in named if n not in (b, CONFIG_NAME)], "half"
    )
    assert error == (
        "rejected the plan: the receiver's check raised LoraMismatch: adapter: 2 of its "
        "tensors do not fit the engine's adapter slots (rank 4): `model.layers.1.self_attn."
        "o_proj`: its lora_B is missing (push A and B together); `rlferry.lora_config`: "
        "missing (an adapter travels with its rank and alpha)"
    )
    assert versions == [1] * 12 and held


def test_a_push_of_the_base_weights_keeps_the_adapter():
    _, named = adapter(1)
    trainer = tiny_model(3).state_dict()

    async def main():
        engine, sender = await joined("base")
        with engine, sender:
            await push(sender, named, 1)
            await push(sender, trainer.items(), 2)
            weights = all(torch.equal(engine.model.state_dict()[k], v) for k, v in trainer.items())
            return weights, same(engine, named), await engine.get_weight_version()

    assert asyncio.run(main()) == (True, True, 2)


def test_lora_config_and_the_engine_option_name_what_is_wrong():
    with pytest.raises(RequestError, match=r"LoraConfig.rank: expected an int >= 1, got 0"):
        LoraConfig(rank=0, alpha=1.0)
    with pytest.raises(RequestError, match=r"LoraConfig.alpha: expected a number > 0, got -1"):
        LoraConfig(rank=2, alpha=-1)
    with pytest.raises(RequestError, match=r"LoraConfig.target_modules: expected a non-empty"):
        LoraConfig(rank=2, alpha=1.0, target_modules="q_proj")
    with pytest.raises(RequestError) as e:
        HFEngine(tiny_model(0), lora=LoraConfig(rank=2, alpha=1.0, target_modules=("qkv",)))
    assert str(e.value) == (
        "LoraConfig.target_modules: expected names of the model's linear layers, got ['qkv'], "
        "which name none of its modules"
    )
    with pytest.raises(RequestError, match=r"HFEngine.lora: expected None or a rlferry"):
        HFEngine(tiny_model(0), lora={"rank": 2})
    assert issubclass(LoraMismatch, WeightSyncError) and issubclass(LoraMismatch, ValueError)


def test_a_peft_adapter_pushes_as_peft_names_it_and_serves_as_peft_generates():
    peft = pytest.importorskip("peft", reason="needs peft (the [lora] extra)")
    model = peft.get_peft_model(
        tiny_model(0),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    named = peft_adapter(model)
    config = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))

    async def main():
        engine, sender = await joined("peft", config)
        with engine, sender:
            await push(sender, named, 1)
            return await greedy(engine), same(engine, named)

    got, held = asyncio.run(main())
    prompt = torch.tensor([req("x", 1).prompt_ids])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert held and got.token_ids == out[0, prompt.shape[1] :].tolist()


@requires_cuda
def test_on_cuda_the_captured_decode_steps_serve_each_pushed_adapter():
    """The slot cache's steps are CUDA graphs captured at start: they read every adapter
    pushed since (A and B stay where they are), and the second replaces the first."""
    first, named1 = adapter(1)
    second, named2 = adapter(2)

    async def main():
        engine = HFEngine(tiny_model(0).cuda(), name="e", lora=CONFIG)
        sender = WeightSender(group="cuda", transport="shm")  # from the CPU, as a trainer may
        await engine.init_weight_transfer("cuda", sender.address)
        out = []
        with engine, sender:
            assert engine.kv_cache == "slots"
            for version, named in ((1, named1), (2, named2)):
                await push(sender, named, version)
                out.append(await greedy(engine, f"v{version}"))
        for layers in (first, second):
            with HFEngine(merged(layers).cuda(), kv_cache="dynamic") as reference:
                out.append(await greedy(reference))
        return out

    one, two, want1, want2 = asyncio.run(main())
    assert one.token_ids == want1.token_ids and two.token_ids == want2.token_ids
    assert one.token_ids != two.token_ids and two.versions == [2] * 12
    assert two.logprobs == pytest.approx(want2.logprobs, abs=1e-4)
