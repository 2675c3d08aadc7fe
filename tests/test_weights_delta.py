"""Delta pushes on CPU: bit for bit against a full push over shm (packed and zero copy) and
gloo, after real AdamW steps on a tiny transformers model (fp32 master weights, bf16
serving); who gets a full push; the refusal of a delta against a base a receiver lacks;
``Delta.apply_``; the budget; the measured choice of the kind."""

import asyncio
import gc
import multiprocessing as mp
import os
import time

import pytest
import torch

from rlferry.errors import RequestError
from rlferry.weights import (
    ParamLoader,
    ShardedSender,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    fingerprint,
)
from rlferry.weights.delta import Delta, DeltaBaseMissing, _policy
from rlferry.weights.delta._base import KeptBase
from rlferry.weights.delta._record import BLOCK, layout, parts_name
from rlferry.weights.sender._deltas import DeltaPushes

transformers = pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")

BF16 = torch.bfloat16
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class Trainer:
    """A tiny Llama with fp32 master weights, stepped by AdamW on random tokens."""

    def __init__(self, seed=0, lr=1e-5):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
        )  # fmt: skip
        self.model = transformers.LlamaForCausalLM(config)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self):
        ids = torch.randint(0, 64, (2, 16))
        self.model(ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self):
        return self.model.state_dict()

    def serving(self):
        return {k: v.to(BF16) for k, v in self.state().items()}


class Engine:
    """bf16 parameters loaded by ParamLoader (deltas in place); counts what each load got."""

    def __init__(self, trainer):
        self.params = {k: torch.zeros(v.shape, dtype=BF16) for k, v in trainer.state().items()}
        self.loader = ParamLoader(self.params)
        self.loads = []  # per load call: the names, and which were deltas
        self.fail_next = False  # the next load raises

    def load(self, items):
        self.loads.append([(n, isinstance(t, Delta)) for n, t in items])
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the engine ran out of memory")
        self.loader(items)

    def holds(self, state):
        return fingerprint(self.params.items()) == fingerprint(state.items())


def join(sender, engine, name, deltas="in_place", **kw):
    return WeightReceiver(
        group="d", address=sender.address, load=engine.load, name=name, deltas=deltas,
        expected=engine.params, **kw,
    ).start()  # fmt: skip


def push(sender, trainer, version, **kw):
    return sender.push(trainer.state().items(), version=version, dtype=BF16, timeout=30, **kw)


def delta_sender(transport="shm", **kw):
    """A sender of deltas whenever a push may be one (the measured choice has tests of its
    own)."""
    kw.setdefault("delta_budget", 1 << 30)
    kw.setdefault("delta_policy", "always")
    return WeightSender(group="d", transport=transport, bucket_bytes=64 << 10, **kw)


# -- bit for bit, over every CPU transport -------------------------------------------------


@pytest.mark.parametrize(
    ("transport", "zero_copy"),
    [("shm", True), ("shm", False), ("broadcast", True)],
    ids=["shm-zero_copy", "shm-packed", "gloo"],
)
def test_delta_pushes_after_adamw_steps_are_bit_identical_to_full_pushes(transport, zero_copy):
    trainer = Trainer()
    engine = Engine(trainer)
    with delta_sender(transport, zero_copy=zero_copy) as s:
        r = join(s, engine, "r0")
        reports = []
        for v in range(1, 6):
            trainer.step()
            reports.append(push(s, trainer, v))
            assert engine.holds(trainer.serving())  # what a full push of the bf16 state gives
        stats = s.statistics()
        r.close()
    assert [x.kind for x in reports] == ["full"] + ["delta"] * 4
    full = sum(t.numel() * 2 for t in trainer.state().values())
    assert all(x.full_bytes == full for x in reports)
    assert reports[0].sent_bytes == full and reports[0].changed is None
    for x in reports[1:]:
        assert 0 < x.changed < 0.5
        assert x.sent_bytes == x.bytes < full / 2  # the changed elements, 3 bytes each
    assert stats.delta_pushes == 4 and stats.delta_bytes == full
    if transport == "broadcast":
        assert stats.groups_formed == 1  # a new plan each push, the group kept


def _engine_process(address, transport, conn):
    """An engine in a process of its own: bf16 parameters, deltas in place; its
    fingerprint after each commit."""
    params = {k: torch.zeros(v.shape, dtype=BF16) for k, v in Trainer().state().items()}
    r = WeightReceiver(
        group="d", address=address, load=ParamLoader(params), deltas="in_place",
        on_commit=lambda v: conn.send((v, fingerprint(params.items()))), name="engine",
    ).start(timeout=60)  # fmt: skip
    conn.send("ready")
    conn.recv()
    r.close()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "broadcast"], ids=["shm", "gloo"])
def test_delta_pushes_to_an_engine_in_another_process_are_bit_identical(transport):
    trainer = Trainer()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    with delta_sender(transport) as s:
        proc = ctx.Process(target=_engine_process, args=(s.address, transport, child))
        proc.start()
        assert parent.poll(120) and parent.recv() == "ready"
        kinds = []
        for v in range(1, 5):
            trainer.step()
            kinds.append(push(s, trainer, v).kind)
            assert parent.recv() == (v, fingerprint(trainer.serving().items()))
        parent.send("stop")
        proc.join(60)
    assert kinds == ["full", "delta", "delta", "delta"]


def test_a_push_in_which_nothing_changed_sends_one_empty_delta():
    trainer = Trainer()
    engine = Engine(trainer)
    with delta_sender() as s:
        r = join(s, engine, "r0")
        push(s, trainer, 1)
        report = push(s, trainer, 2)
        r.close()
    assert (report.kind, report.changed, report.tensors) == ("delta", 0.0, 1)
    assert report.sent_bytes < 64
    assert engine.holds(trainer.serving())


def test_a_delta_push_of_mixed_dtypes_strided_and_empty_tensors_is_exact():
    from test_weights import Engine as Plain
    from test_weights import state

    sd = state()  # fp32, bf16, bool, int64, empty, a transposed view, split over buckets
    engine = Plain(sd)
    with delta_sender() as s:
        r = WeightReceiver(group="d", address=s.address, load=engine.load, deltas="base").start()
        kinds = []
        for v in (1, 2, 3):
            sd["embed"][v, :7] += 1
            sd["t"][1, v] = -sd["t"][1, v]
            sd["mask"][0, v % 3] = ~sd["mask"][0, v % 3]
            sd["step"] += 1
            kinds.append(s.push(sd.items(), version=v, timeout=30).kind)
            assert engine.equals(sd)
        r.close()
    assert kinds == ["full", "delta", "delta"]


# -- who gets a full push --------------------------------------------------------------------


def test_a_late_joiner_gets_a_full_push_and_deltas_after():
    trainer = Trainer()
    first, late = Engine(trainer), Engine(trainer)
    with delta_sender() as s:
        rs = [join(s, first, "first")]
        kinds = []
        for v in range(1, 5):
            if v == 3:
                rs.append(join(s, late, "late"))
            trainer.step()
            report = push(s, trainer, v)
            kinds.append(report.kind)
            assert first.holds(trainer.serving())
        assert report.receivers == ("first", "late")
        assert late.holds(trainer.serving())
        for r in rs:
            r.close()
    assert kinds == ["full", "delta", "full", "delta"]


def test_a_receiver_that_joins_as_a_delta_push_starts_makes_it_start_again_full(monkeypatch):
    trainer = Trainer()
    first, late = Engine(trainer), Engine(trainer)
    with delta_sender() as s:
        rs = [join(s, first, "first")]
        for v in (1, 2):
            trainer.step()
            push(s, trainer, v)
        # the sender's look before the diff misses the late joiner: the push's own check,
        # once it picked its members, finds it
        monkeypatch.setattr(DeltaPushes, "_members", lambda self, version, timeout: (True, True))
        rs.append(join(s, late, "late"))
        trainer.step()
        report = push(s, trainer, 3)
        assert report.kind == "full" and report.receivers == ("first", "late")
        assert first.holds(trainer.serving()) and late.holds(trainer.serving())
        assert s.statistics().failed_pushes == 0
        for r in rs:
            r.close()


def test_a_receiver_that_failed_a_push_gets_a_full_push_next():
    trainer = Trainer()
    engine = Engine(trainer)
    with delta_sender() as s:
        r = join(s, engine, "r0")
        for v in (1, 2):
            trainer.step()
            push(s, trainer, v)
        trainer.step()
        engine.fail_next = True
        with pytest.raises(WeightSyncError) as failed:
            push(s, trainer, 3)
        assert "the engine ran out of memory" in failed.value.failures["r0"]
        trainer.step()
        report = push(s, trainer, 4)
        assert engine.holds(trainer.serving())
        r.close()
    assert report.kind == "full"


def test_a_receiver_made_without_deltas_makes_every_push_full():
    trainer = Trainer()
    takes, plain = Engine(trainer), Engine(trainer)
    with delta_sender() as s:
        rs = [join(s, takes, "takes"), join(s, plain, "plain", deltas=None)]
        kinds = []
        for v in range(1, 4):
            trainer.step()
            kinds.append(push(s, trainer, v).kind)
        assert takes.holds(trainer.serving()) and plain.holds(trainer.serving())
        for r in rs:
            r.close()
    assert kinds == ["full"] * 3
    assert not any(d for load in takes.loads for _, d in load)
    assert s.statistics().delta_pushes == 0


def parked(sender, names):
    """Wait (on the sender's own wake-ups) until every receiver of ``names`` asks for work:
    its word on the push before reached the sender."""
    parts = sender._pusher.parts

    def ready():
        ms = [m for m in parts.hub.members.values() if m.name in names]
        return len(ms) == len(names) and all(m.idle for m in ms)

    assert parts.loop.run(parts.hub.until(ready, time.monotonic() + 10))


def test_a_delta_against_a_base_the_receiver_lacks_is_refused_before_any_byte_moves():
    trainer = Trainer()
    engine = Engine(trainer)
    with delta_sender() as s:
        r = join(s, engine, "r0")
        for v in (1, 2):
            trainer.step()
            push(s, trainer, v)
        held = trainer.serving()
        parked(s, ["r0"])
        r._loader.deltas.holds = 1  # its version changed behind the sender's back
        loads = len(engine.loads)
        trainer.step()
        with pytest.raises(DeltaBaseMissing) as refused:
            push(s, trainer, 3)
        assert isinstance(refused.value, ValueError)  # a RequestError
        why = refused.value.failures["r0"]
        assert why.startswith(
            "refused the delta push: it is made against version 2, this receiver holds version 1 ("
        )
        assert "no bucket moved" in str(refused.value)
        assert len(engine.loads) == loads  # nothing loaded
        assert engine.holds(held) and r.version == 2  # it keeps serving its version
        report = push(s, trainer, 4)
        assert report.kind == "full" and engine.holds(trainer.serving())
        r.close()


# -- Delta.apply_ ----------------------------------------------------------------------------


def encoded(old, new):
    """``new``'s delta from ``old`` as a receiver reads it (None: left out, or dense)."""
    base = KeptBase(1 << 30, "device")
    base.refresh([("t", old)], 1)
    enc = base.encode([("t", new)], 2)
    assert torch.equal(base.kept[0].view(-1).view(torch.uint8), new.view(-1).view(torch.uint8))
    if not enc.sparse:
        return None
    (name, shape, dtype, changed), ((pushed, data),) = enc.sparse[0], enc.pushed
    assert pushed == parts_name("t") and name == "t"
    return Delta.from_bytes(data, shape, dtype, changed)


@pytest.mark.parametrize("dtype", [BF16, torch.float32, torch.float16, torch.int8, torch.bool])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 3 * BLOCK + 17])
def test_delta_apply_writes_the_changed_elements_as_a_reference_does(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    old = (torch.randn(numel, generator=g) * 100).to(dtype)
    idx = torch.randperm(numel, generator=g)[: max(1, numel // 50)]
    new = old.clone()
    if dtype == torch.bool:
        new[idx] = ~old[idx]
    else:  # the last bit of each, flipped
        new.view(-1).view(INTS[old.element_size()])[idx] ^= 1
    reference = old.clone()
    reference[idx] = new[idx]
    delta = encoded(old, new)
    size = old.element_size()
    if layout(numel, idx.numel(), size)[3] > 0.9 * numel * size:  # sparse does not pay: dense
        assert delta is None
        return
    assert delta is not None and delta.changed == idx.numel()
    got = delta.apply_(old.clone())
    assert torch.equal(got.view(torch.uint8), reference.view(torch.uint8))


def test_a_delta_is_bit_exact_for_signed_zeros_and_nan_payloads():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0] * 100)
    new = old.clone()
    new[0] = -0.0  # equal as floats, not as bits
    new.view(torch.int32)[2] ^= 1  # another NaN
    delta = encoded(old, new)
    assert delta is not None and delta.changed == 2
    assert torch.equal(delta.apply_(old.clone()).view(torch.int32), new.view(torch.int32))


def test_a_delta_built_by_hand_is_applied_block_by_block():
    t = torch.zeros(600)
    counts = torch.tensor([2, 0, 1], dtype=torch.int16)  # blocks of 256
    offsets = torch.tensor([3, 255, 80], dtype=torch.uint8)
    values = torch.tensor([1.0, 2.0, 3.0])
    Delta(counts, offsets, values, (600,), torch.float32).apply_(t)
    assert t.nonzero().squeeze(1).tolist() == [3, 255, 2 * 256 + 80]
    assert t[[3, 255, 2 * 256 + 80]].tolist() == [1.0, 2.0, 3.0]


def test_delta_apply_refuses_another_shape_dtype_or_a_strided_tensor():
    d = Delta(torch.zeros(1, dtype=torch.int16), torch.zeros(0, dtype=torch.uint8),
              torch.zeros(0, dtype=BF16), (4, 8), BF16)  # fmt: skip
    with pytest.raises(RequestError, match=r"expected a tensor of shape \[4, 8\] bfloat16, got "
                       r"\[8, 4\] bfloat16"):  # fmt: skip
        d.apply_(torch.zeros(8, 4, dtype=BF16))
    with pytest.raises(RequestError, match="got \\[4, 8\\] float32"):
        d.apply_(torch.zeros(4, 8))
    with pytest.raises(RequestError, match="expected a contiguous tensor"):
        d.apply_(torch.zeros(8, 4, dtype=BF16).t())


# -- the budget, the receiver's modes, the options ---------------------------------------------


def test_tensors_past_the_budget_are_sent_dense_and_the_base_stays_within_it():
    trainer = Trainer()
    engine = Engine(trainer)
    sizes = [(n, t.numel() * 2) for n, t in trainer.state().items()]
    budget = sum(b for _, b in sizes) // 3
    with delta_sender(delta_budget=budget) as s:
        r = join(s, engine, "r0")
        for v in (1, 2):
            trainer.step()
            report = push(s, trainer, v)
        stats = s.statistics()
        r.close()
    assert engine.holds(trainer.serving())
    assert report.kind == "delta" and 0 < stats.delta_bytes <= budget
    kept, used = set(), 0
    for n, b in sizes:  # the first tensors in push order that fit
        if used + b <= budget:
            kept.add(n)
            used += b
    assert used == stats.delta_bytes
    last = {n: d for load in engine.loads[-3:] for n, d in load}
    assert {n for n, d in last.items() if d} <= kept
    assert {n for n, _ in sizes if n not in kept} <= {n for n, d in last.items() if not d}


@pytest.mark.parametrize("mode", ["base", "whole"])
def test_a_base_receiver_loads_whole_tensors_rebuilt_from_its_copy(mode):
    trainer = Trainer()
    engine = Engine(trainer)
    with delta_sender() as s:
        r = join(s, engine, "r0", deltas=mode)
        for v in (1, 2, 3):
            before, held = len(engine.loads), trainer.serving()
            trainer.step()
            push(s, trainer, v)
            assert engine.holds(trainer.serving())
        r.close()
    names = [n for load in engine.loads[before:] for n, d in load if not d]
    assert not any(d for load in engine.loads for _, d in load)  # tensors, never a Delta
    if mode == "whole":  # every tensor, once the last bucket came
        assert names == list(trainer.state())
    else:  # only what the push carried: the tensors that changed
        now = trainer.serving()
        changed = [
            n
            for n, t in now.items()
            if not torch.equal(t.view(torch.int16), held[n].view(torch.int16))
        ]
        assert sorted(names) == sorted(changed)


def test_push_dtype_casts_floating_point_tensors_only():
    with delta_sender(delta_budget=0) as s:
        got = {}
        r = WeightReceiver(group="d", address=s.address, load=lambda i: got.update(
            {n: t.clone() for n, t in i})).start()  # fmt: skip
        report = s.push({"w": torch.ones(3), "step": torch.tensor([7])}.items(), version=1,
                        dtype=BF16)  # fmt: skip
        r.close()
    assert got["w"].dtype == BF16 and got["step"].dtype == torch.int64
    assert (report.kind, report.sent_bytes, report.full_bytes) == ("full", report.bytes, 14)


def test_the_options_are_checked_naming_the_field():
    with pytest.raises(RequestError, match=r"WeightSender.delta_budget: expected an int >= 0"):
        WeightSender(group="d", delta_budget=-1)
    with pytest.raises(RequestError, match=r"WeightSender.delta_base: expected 'device' or "
                       r"'host', got 'gpu'"):  # fmt: skip
        WeightSender(group="d", delta_budget=1, delta_base="gpu")
    with pytest.raises(RequestError, match=r"WeightSender.delta_policy: expected 'measured' or "
                       r"'always', got 'often'"):  # fmt: skip
        WeightSender(group="d", delta_budget=1, delta_policy="often")
    with pytest.raises(RequestError, match=r"WeightReceiver.deltas: expected None, 'in_place', "
                       r"'base' or 'whole', got 'yes'"):  # fmt: skip
        WeightReceiver(group="d", address="ipc:///x", load=print, deltas="yes")


def test_a_sharded_sender_refuses_a_delta_budget_naming_why():
    from rlferry.weights import fsdp_layout, tp_layout
    from rlferry.weights.planning import TensorSpec

    specs = [TensorSpec("w", (8, 8), BF16)]
    with pytest.raises(RequestError, match=r"ShardedSender.delta_budget: delta pushes go "):
        ShardedSender(group="d", rank=0, trainer=fsdp_layout(specs, 1),
                      engine=tp_layout(specs, 1), delta_budget=1 << 20)  # fmt: skip


# -- zero copy and new plans: nothing leaks ---------------------------------------------------


def test_shm_zero_copy_alternating_with_delta_pushes_leaks_no_buffers_or_descriptors():
    trainer = Trainer()
    engine = Engine(trainer)
    serving = trainer.serving()  # the same tensors every push: zero copy for full pushes

    def once(v, **kw):
        for t in serving.values():
            t.view(torch.int16)[:1] += 1
        return s.push(serving.items(), version=v, timeout=30, **kw)

    def held():
        gc.collect()  # a dropped mapping's descriptor closes with its last view
        return len(os.listdir("/proc/self/fd")), s.statistics().buffer_bytes

    with delta_sender() as s:
        r = join(s, engine, "r0")
        kinds = [once(v, full=v % 2 == 1).kind for v in range(1, 7)]  # warm: both ways
        before = held()
        for v in range(7, 27):
            once(v, full=v % 2 == 1)
        assert engine.holds(serving)
        assert held() == before
        r.close()
    assert kinds == ["full", "delta"] * 3


# -- the measured choice -----------------------------------------------------------------------


def run_policy(p, times, n):
    """``n`` pushes chosen by ``p``, each kind taking ``times[kind]`` (seconds, or an iterator
    of them): their kinds' initials."""
    seen = []
    for _ in range(n):
        kind = p.choose()
        seen.append(kind[0])
        t = times[kind]
        p.timed(kind, t if isinstance(t, float) else next(t))
    return "".join(seen)


def test_the_policy_measures_each_kind_then_pushes_the_faster_trying_the_other_later():
    p = _policy.Policy()
    # each kind timed twice (the first push of a kind after the other is not timed); a
    # little slower: tried again (a switch, two timed pushes) after 8 timed pushes
    cycle = "fff" + "ddd" + "d" * 8  # a try, then the faster measured again and kept
    assert run_policy(p, {"delta": 1.0, "full": 1.05}, 2 + 3 + 11 + 2 * len(cycle)) == (
        "dd" + "fff" + "d" * 11 + cycle * 2
    )


def test_the_policy_keeps_the_slower_kind_out_when_a_switch_makes_one_push_slow():
    p = _policy.Policy()
    seen = []
    for seconds in (2.0, 2.0, 9.0, 1.0, 1.0, 1.0):  # deltas; a full push paying the switch
        kind = p.choose()
        seen.append(kind[0])
        p.timed(kind, seconds)
    assert "".join(seen) == "ddffff"  # full pushes measured at 1 s, not 9: they win


def test_one_slow_early_push_does_not_decide_which_kind_wins():
    """Over NCCL between two GPUs: deltas 46 ms, full pushes 13 ms but one of the first at
    199 ms (an early broadcast's one-off): full pushes still win."""
    p = _policy.Policy()
    fulls = iter([0.199] + [0.013] * 40)
    assert run_policy(p, {"delta": 0.046, "full": fulls}, 30) == "dd" + "f" * 28


def test_the_policy_tries_a_much_slower_kind_as_seldom_as_it_costs():
    p = _policy.Policy()
    p.refreshed(0.5)
    # a delta's try costs two pushes 9 s longer and a copy of 0.5 s: at 2% of 1 s pushes,
    # 925 pushes apart
    seen = run_policy(p, {"delta": 10.0, "full": 1.0}, 2 + 3 + 925 + 3)
    assert seen == "ddfff" + "f" * 925 + "ddd"


def test_the_policy_swaps_kinds_when_the_faster_slows_past_the_other():
    p = _policy.Policy()
    assert run_policy(p, {"delta": 1.0, "full": 2.0}, 8) == "ddfffddd"
    # one slower delta does not swap (the lower median of its last three: 1 s); two do
    assert run_policy(p, {"delta": 4.0, "full": 2.0}, 6) == "ddffff"


def test_an_always_policy_chooses_deltas_and_keeps_the_base_up_whatever_the_times():
    p = _policy.Policy(always=True)
    for kind, seconds in (("delta", 9.0), ("full", 1.0), ("delta", 9.0)):
        assert (p.choose(), p.keep_base()) == ("delta", True)
        p.timed(kind, seconds)


def test_the_policy_keeps_the_base_up_only_when_the_next_push_may_be_a_delta():
    p = _policy.Policy()
    for kind in ("delta", "delta", "full", "full", "full"):  # "full" first: the switch
        p.timed(kind, 1.1 if kind == "delta" else 1.0)
    keeps = []  # full pushes faster: a delta's try 11 pushes apart (its two pushes 0.1 s
    for _ in range(16):  # slower each: 0.2 s, 2% of 1 s pushes, 10 and a rounding)
        kind = p.choose()
        keeps.append((kind[0], p.keep_base() if kind == "full" else None))
        p.timed(kind, 1.1 if kind == "delta" else 1.0)
    assert keeps == ([("f", False)] * 10 + [("f", True)] + [("d", None)] * 3 + [("f", False)] * 2)


# -- HFEngine --------------------------------------------------------------------------------


def test_hf_engine_takes_deltas_in_place_and_generates_as_a_fresh_engine_with_the_weights():
    from rlferry.control import GenerateRequest, SamplingParams
    from rlferry.engines.hf import HFEngine

    trainer = Trainer(lr=1e-4)
    served = Trainer(seed=1).model.to(BF16).eval()
    req = GenerateRequest(request_id="a", prompt_ids=[1, 2, 3, 4],
                          params=SamplingParams(max_tokens=12, temperature=0.0))  # fmt: skip

    async def main():
        engine = HFEngine(served, name="e")
        with engine, delta_sender() as s:
            await engine.init_weight_transfer("d", s.address)
            kinds = []
            for v in (1, 2, 3):
                trainer.step()
                await engine.start_weight_update()
                report = await asyncio.to_thread(push, s, trainer, v)
                await engine.finish_weight_update(v)
                kinds.append(report.kind)
            got = await engine.generate(req)
        fresh = Trainer(seed=2).model.to(BF16).eval()
        fresh.load_state_dict(trainer.serving())
        with HFEngine(fresh, name="fresh") as reference:
            want = await reference.generate(req)
        return kinds, got, want

    kinds, got, want = asyncio.run(main())
    assert kinds == ["full", "delta", "delta"]
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
