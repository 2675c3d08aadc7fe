"""The weight plane on CPU, sender and receivers in one process: shm transport, plan, config."""

import pathlib
import re

import numpy as np
import pytest
import torch

from rlferry.weights import WeightReceiver, WeightSender, WeightSyncError
from rlferry.weights.copies._pack import bucketed
from rlferry.weights.planning import TensorSpec
from rlferry.weights.planning._buckets import ALIGN, Plan


def state(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    sd = {f"layers.{i}.weight": torch.randn(64, 33, generator=g) for i in range(n)}
    sd["embed"] = torch.randn(300, 1000, generator=g)  # 1.2 MB: split over buckets of 256 KiB
    sd["norm.bf16"] = torch.randn(77, generator=g).bfloat16()
    sd["mask"] = torch.rand(5, 3, generator=g) > 0.5
    sd["step"] = torch.tensor(7, dtype=torch.int64)
    sd["empty"] = torch.zeros(0, 4)
    sd["t"] = torch.randn(8, 4, generator=g).t()  # non-contiguous
    return sd


class Engine:
    """A fake engine: preallocated parameters, a load that copies into them."""

    def __init__(self, like):
        self.params = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in like.items()}
        self.loads = []
        self.commits = []

    def load(self, items):
        self.loads.append([n for n, _ in items])
        for n, t in items:
            self.params[n].copy_(t)

    def on_commit(self, version):
        self.commits.append(version)

    def equals(self, sd):
        return all(torch.equal(self.params[k], v) for k, v in sd.items())


@pytest.fixture(params=[True, False], ids=["zero_copy", "packed"])
def sender(request):
    """Both ways a push goes over shm: read in place (the default; ``state``'s strided
    tensor too) and packed into bucket buffers."""
    s = WeightSender(
        group="rollout", transport="shm", receivers=2, bucket_bytes=256 << 10,
        zero_copy=request.param,
    )  # fmt: skip
    yield s
    s.close()


@pytest.fixture
def direct_sender():
    s = WeightSender(group="rollout", transport="shm", receivers=2, bucket_bytes=256 << 10)
    yield s
    s.close()


def start(sender, engine, name, **kw):
    return WeightReceiver(
        group="rollout",
        address=sender.address,
        load=engine.load,
        on_commit=engine.on_commit,
        name=name,
        **kw,
    ).start()


# -- configuration ------------------------------------------------------------------------


def test_sender_rejects_an_unknown_transport_naming_the_field():
    with pytest.raises(ValueError) as e:
        WeightSender(group="g", transport="nccl")
    assert str(e.value) == (
        "WeightSender.transport: expected one of 'shm', 'cuda_ipc', 'broadcast', got 'nccl'"
    )


def test_sender_rejects_zero_receivers():
    with pytest.raises(ValueError) as e:
        WeightSender(group="g", receivers=0)
    assert str(e.value) == "WeightSender.receivers: expected an int >= 1, got 0"


def test_sender_rejects_a_tiny_bucket():
    with pytest.raises(ValueError) as e:
        WeightSender(group="g", bucket_bytes=100)
    assert str(e.value) == (
        "WeightSender.bucket_bytes: expected an int >= 4096 (or None: chosen from free memory), "
        "got 100"
    )


def test_sender_rejects_an_empty_group_name():
    with pytest.raises(ValueError) as e:
        WeightSender(group="")
    assert str(e.value) == "WeightSender.group: expected a non-empty str, got ''"


def test_cuda_ipc_sender_rejects_a_cpu_device():
    with pytest.raises(ValueError) as e:
        WeightSender(group="g", transport="cuda_ipc", device="cpu")
    assert str(e.value) == (
        "WeightSender.device: expected a CUDA device for transport 'cuda_ipc', got 'cpu'"
    )


def test_receiver_rejects_a_load_that_is_not_callable():
    with pytest.raises(ValueError) as e:
        WeightReceiver(group="g", address="ipc:///tmp/x", load=3)
    assert str(e.value) == (
        "WeightReceiver.load: expected a callable taking a list of (name, tensor), got int"
    )


def test_receiver_rejects_an_address_that_is_not_one():
    with pytest.raises(ValueError) as e:
        WeightReceiver(group="g", address="localhost", load=print)
    assert str(e.value) == (
        "WeightReceiver.address: expected the sender's address (tcp://HOST:PORT or ipc://PATH, "
        "from sender.address), got 'localhost'"
    )


def test_receiver_of_another_group_cannot_join(sender):
    r = WeightReceiver(group="eval", address=sender.address, load=print, name="r0")
    with pytest.raises(WeightSyncError) as e:
        r.start(timeout=10)
    assert str(e.value) == (
        f"receiver `r0` cannot join group 'eval' at {sender.address}: "
        "group: expected 'rollout' (this sender's), got 'eval' (give the group the sender "
        "was made with)"
    )


def test_push_rejects_a_version_that_is_not_an_int(sender):
    with pytest.raises(ValueError) as e:
        sender.push([("a", torch.zeros(1))], version="7")
    assert str(e.value) == "push.version: expected an int, got '7'"


# -- the plan -------------------------------------------------------------------------------


def specs(*sizes, dtype=torch.float32):
    return [TensorSpec(f"t{i}", (n,), dtype) for i, n in enumerate(sizes)]


def test_plan_puts_every_chunk_at_a_256_byte_aligned_offset():
    plan = Plan.build(specs(3, 100, 1, 77, 5), bucket_bytes=1024)
    assert all(c.offset % ALIGN == 0 for c in plan.chunks)
    assert [(c.bucket, c.offset) for c in plan.chunks] == [
        (0, 0),
        (0, 256),
        (0, 768),
        (1, 0),
        (1, 512),
    ]


def test_plan_splits_a_tensor_larger_than_a_bucket_into_consecutive_pieces():
    plan = Plan.build(specs(10, 1000), bucket_bytes=1024)  # 40 B, then 4000 B
    pieces = [c for c in plan.chunks if c.tensor == 1]
    assert [(c.start, c.length, c.bucket) for c in pieces] == [
        (0, 768, 0),
        (768, 1024, 1),
        (1792, 1024, 2),
        (2816, 1024, 3),
        (3840, 160, 4),
    ]
    assert sum(c.length for c in pieces) == 4000


def ramped(sizes, bucket=1024 << 10, ramp=64 << 10):  # buckets of 16 ramps: ramped
    return Plan.build(specs(*sizes), bucket, ramp)


def test_a_ramped_plan_has_small_buckets_at_both_ends_and_lays_every_byte_once():
    # a large first and last tensor (an embedding, a head) around small and middle ones
    sizes = [200_000] + [3_000, 60_000, 8_000, 150_000] * 12 + [200_000, 1_000]
    plan = ramped(sizes)
    flat = Plan.build(specs(*sizes), 1024 << 10)
    used = plan.bucket_used
    assert used[0] <= 64 << 10 and used[-1] <= 128 << 10 and max(used) <= 1024 << 10
    assert used[1] <= 2 * (64 << 10) + 60_000 * 4  # rising: at most twice the last, or a tensor
    assert plan.buckets > flat.buckets and not plan.split()  # small ends, nothing split
    covered = {}
    for b, chunks in enumerate(plan.by_bucket()):
        end = 0
        for c in sorted(chunks, key=lambda c: c.offset):
            assert c.offset >= end and c.offset + c.length <= used[b]
            end = c.offset + c.length
        for c in chunks:
            covered[c.tensor] = covered.get(c.tensor, 0) + c.length
    assert covered == {i: n * 4 for i, n in enumerate(sizes)}
    # the ends hold small tensors; the large ones keep their order in between
    assert {c.tensor for c in plan.by_bucket()[0]} <= {
        i for i, n in enumerate(sizes) if n * 4 <= 64 << 10
    }
    middle = [c.tensor for c in plan.chunks if sizes[c.tensor] * 4 > 64 << 10]
    assert middle == sorted(middle)
    assert plan.fingerprint != flat.fingerprint and Plan.from_wire(plan.to_wire()) == plan


def test_a_push_of_at_most_four_ramps_is_not_ramped():
    assert (
        ramped([8_000] * 8).bucket_used == Plan.build(specs(*[8_000] * 8), 1024 << 10).bucket_used
    )


def test_a_ramped_plan_streams_from_a_generator_every_bucket_with_its_tensors():
    sizes = [200_000] + [3_000, 60_000, 8_000, 150_000] * 12 + [200_000, 1_000]
    plan = ramped(sizes)
    tensors = [torch.full((n,), float(i)) for i, n in enumerate(sizes)]
    pairs = ((f"t{i}", t) for i, t in enumerate(tensors))
    seen = 0
    for k, got in bucketed(plan, pairs, checked=True):
        assert k == seen
        for c in plan.by_bucket()[k]:
            assert got[c.tensor] is tensors[c.tensor]
        seen += 1
    assert seen == plan.buckets


def test_plan_travels_as_plain_data_and_comes_back_equal():
    plan = Plan.build(specs(10, 1000, 3, dtype=torch.bfloat16), bucket_bytes=1024)
    assert Plan.from_wire(plan.to_wire()) == plan


def test_plan_refuses_a_name_pushed_twice():
    with pytest.raises(WeightSyncError) as e:
        Plan.build([TensorSpec("a", (1,), torch.float32)] * 2, 1024)
    assert str(e.value) == "tensor `a` is pushed twice (every name of one push must be unique)"


def test_a_plan_with_a_chunk_out_of_range_is_refused():
    wire = Plan.build(specs(10), 1024).to_wire()
    wire["chunks"] = [0, 0, 40, 0, 2048]
    with pytest.raises(WeightSyncError) as e:
        Plan.from_wire(wire)
    assert str(e.value) == "malformed plan: chunk (0, 0, 40, 0, 2048) out of range"


# -- pushes over shm ------------------------------------------------------------------------


def test_push_delivers_every_tensor_exactly_to_every_receiver(sender):
    sd = state()
    engines = [Engine(sd), Engine(sd)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    report = sender.push(sd.items(), version=1, timeout=30)
    assert all(e.equals(sd) for e in engines)
    assert report.receivers == ("r0", "r1")
    assert report.bytes == sum(t.numel() * t.element_size() for t in sd.values())
    assert report.tensors == len(sd) and report.buckets > 4 and report.plan_sent
    assert [r.version for r in rs] == [1, 1]
    for r in rs:
        r.close()


def test_version_changes_only_after_every_bucket_was_loaded_then_on_commit_runs(sender):
    sd = state()
    seen = []
    holder = {}

    def load(items):
        seen.append(holder["r"].version)  # still the old version while buckets arrive

    def on_commit(version):
        seen.append(("commit", version, holder["r"].version))

    holder["r"] = WeightReceiver(
        group="rollout", address=sender.address, load=load, on_commit=on_commit
    ).start()
    other = start(sender, Engine(sd), "other")
    sender.push(sd.items(), version=5, timeout=30)
    assert seen[:-1] == [None] * (len(seen) - 1) and len(seen) >= 3
    assert seen[-1] == ("commit", 5, None)  # on_commit runs before the version shows
    assert holder["r"].version == 5
    holder["r"].close()
    other.close()


def test_later_pushes_send_no_plan_and_open_no_buffer_again(sender):
    sd = state()
    engines = [Engine(sd), Engine(sd)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    reports, opened = [], []
    for v in range(1, 4):
        for t in sd.values():
            if t.dtype.is_floating_point:
                t.add_(1)
        reports.append(sender.push(sd.items(), version=v, timeout=30))
        assert all(e.equals(sd) for e in engines)
        opened.append([r.statistics().buffers_opened for r in rs])
    assert [r.plan_sent for r in reports] == [True, False, False]
    # packed: the two buffers; zero copy: each tensor's storage (the strided one's too)
    want = 2 if sender.statistics().buffer_bytes else sum(1 for t in sd.values() if t.numel())
    assert opened == [[want, want]] * 3
    assert [e.commits for e in engines] == [[1, 2, 3]] * 2
    stats = sender.statistics()
    assert (stats.pushes, stats.plans_sent, stats.receivers) == (3, 1, 2)
    for r in rs:
        r.close()


def test_a_wrong_shape_fails_the_push_before_any_bucket_moves(sender):
    sd = state()
    wrong = dict(sd)
    wrong["layers.1.weight"] = torch.zeros(64, 34)
    wrong["extra"] = torch.zeros(2)
    good = Engine(sd)
    strict = Engine(sd)
    r0 = start(sender, good, "good")
    r1 = start(sender, strict, "strict", expected=strict.params)
    with pytest.raises(WeightSyncError) as e:
        sender.push(wrong.items(), version=1, timeout=30)
    assert str(e.value) == (
        "push of version 1: receiver `strict` (pid "
        + str(__import__("os").getpid())
        + f" on {__import__('socket').gethostname()}): rejected the plan: 2 of {len(wrong)} "
        "tensors differ from the receiver's parameters: `layers.1.weight`: expected shape "
        "[64, 33] float32, got shape [64, 34] float32; `extra`: not a parameter of the "
        "receiver, got shape [2] float32; no bucket moved"
    )
    assert list(e.value.failures) == ["strict"]
    assert good.loads == [] and strict.loads == []
    assert r0.version is None and r1.version is None
    report = sender.push(sd.items(), version=2, timeout=30)  # the right layout goes through
    assert report.receivers == ("good", "strict") and strict.equals(sd)
    r0.close()
    r1.close()


def test_a_new_layout_sends_a_new_plan(sender):
    sd = state()
    engines = [Engine(sd), Engine(sd)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    sender.push(sd.items(), version=1, timeout=30)
    smaller = {k: v for k, v in sd.items() if k != "embed"}
    report = sender.push(smaller.items(), version=2, timeout=30)
    assert report.plan_sent and report.tensors == len(sd) - 1
    assert all(e.equals(smaller) for e in engines)
    for r in rs:
        r.close()


def test_a_receiver_whose_load_raises_fails_the_push_by_name_and_the_others_commit(sender):
    sd = state()
    good = Engine(sd)
    calls = []

    def bad_load(items):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")

    r0 = start(sender, good, "good")
    r1 = WeightReceiver(group="rollout", address=sender.address, load=bad_load, name="bad").start()
    with pytest.raises(WeightSyncError) as e:
        sender.push(sd.items(), version=1, timeout=30)
    msg = str(e.value)
    assert msg.startswith("push of version 1: receiver `bad` (pid ")
    assert re.search(
        r"load raised RuntimeError: out of memory \(at bucket \d+ of \d+, version 1\); "
        r"1 committed it$",
        msg,
    )
    assert e.value.failures["bad"].startswith("load raised RuntimeError: out of memory")
    assert e.value.report.receivers == ("good",)
    assert (r0.version, r1.version) == (1, None) and good.equals(sd)
    assert r1.statistics().last_error.startswith("load raised RuntimeError")
    report = sender.push(sd.items(), version=2, timeout=30)  # the next push reaches both
    assert report.receivers == ("good", "bad") and (r0.version, r1.version) == (2, 2)
    r0.close()
    r1.close()


def test_a_generator_streams_against_the_previous_layout(sender):
    sd = state()
    engines = [Engine(sd), Engine(sd)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    first = sender.push(((k, v) for k, v in sd.items()), version=1, timeout=30)
    for t in sd.values():
        if t.dtype.is_floating_point:
            t.mul_(2)
    second = sender.push(((k, v.clone()) for k, v in sd.items()), version=2, timeout=30)
    assert first.plan_sent and not second.plan_sent
    assert all(e.equals(sd) for e in engines)
    for r in rs:
        r.close()


def test_a_generator_that_changes_layout_midway_aborts_and_nobody_commits(sender):
    sd = state()
    engines = [Engine(sd), Engine(sd)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    sender.push(sd.items(), version=1, timeout=30)

    def changed():
        for k, v in sd.items():
            yield (k, torch.zeros(3) if k == "step" else v)

    with pytest.raises(WeightSyncError) as e:
        sender.push(changed(), version=2, timeout=30)
    assert str(e.value) == (
        f"push of version 2: named_tensors[{list(sd).index('step')}]: expected `step` shape [] "
        "int64 (the layout), got `step` shape [3] float32"
    )
    assert [r.version for r in rs] == [1, 1]
    assert sender.push(sd.items(), version=3, timeout=30).receivers == ("r0", "r1")
    for r in rs:
        r.close()


def test_a_push_with_a_layout_argument_plans_before_reading_the_generator(sender):
    sd = state()
    engines = [Engine(sd), Engine(sd)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    meta = [(k, torch.empty(v.shape, dtype=v.dtype, device="meta")) for k, v in sd.items()]
    report = sender.push(iter(sd.items()), version=1, timeout=30, layout=meta)
    assert report.plan_sent and all(e.equals(sd) for e in engines)
    for r in rs:
        r.close()


def test_a_receiver_that_joins_later_gets_the_plan_and_the_next_push(sender):
    sd = state()
    engines = [Engine(sd) for _ in range(3)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines[:2])]
    sender.push(sd.items(), version=1, timeout=30)
    rs.append(start(sender, engines[2], "late"))  # the next push waits for it to be ready
    report = sender.push(sd.items(), version=2, timeout=30)
    assert report.plan_sent and report.receivers == ("r0", "r1", "late")
    assert engines[2].equals(sd) and rs[2].version == 2
    for r in rs:
        r.close()


def test_a_receiver_that_closed_is_dropped_and_the_next_push_reaches_the_others(sender):
    sd = state()
    engines = [Engine(sd), Engine(sd)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    sender.push(sd.items(), version=1, timeout=30)
    rs[1].close()  # it leaves: the sender knows before close returns
    report = sender.push(sd.items(), version=2, timeout=30)
    assert report.receivers == ("r0",) and rs[0].version == 2
    rs[0].close()


def test_verify_checks_every_bucket_and_passes_on_intact_data(sender):
    sd = state()
    engines = [Engine(sd), Engine(sd)]
    rs = [start(sender, e, f"r{i}", verify=True) for i, e in enumerate(engines)]
    sender.push(sd.items(), version=1, timeout=30)
    assert all(e.equals(sd) for e in engines) and [r.version for r in rs] == [1, 1]
    for r in rs:
        r.close()


def test_two_groups_with_different_transports_in_one_process():
    sd = state()
    a = WeightSender(group="a", transport="shm", bucket_bytes=256 << 10)
    b = WeightSender(group="b", transport="broadcast", bucket_bytes=256 << 10)
    ea, eb = Engine(sd), Engine(sd)
    ra = WeightReceiver(group="a", address=a.address, load=ea.load).start()
    rb = WeightReceiver(group="b", address=b.address, load=eb.load).start()
    a.push(sd.items(), version=1, timeout=30)
    b.push(sd.items(), version=1, timeout=30)
    assert ea.equals(sd) and eb.equals(sd)
    for x in (ra, rb, a, b):
        x.close()


def test_the_weight_plane_never_sleeps_or_polls():
    src = pathlib.Path(__file__).parents[1] / "src" / "rlferry" / "weights"
    text = "\n".join(p.read_text() for p in src.rglob("*.py"))
    assert "time.sleep(" not in text and "asyncio.sleep(" not in text


# -- shm zero copy -----------------------------------------------------------------------------


def contiguous_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {f"w{i}": torch.randn(128, 256, generator=g) for i in range(4)}
    sd["b"] = torch.randn(7, generator=g).bfloat16()
    sd["empty"] = torch.zeros(0, 3)
    return sd


def test_shm_zero_copy_receivers_read_the_trainers_tensors_in_place(direct_sender):
    sender = direct_sender
    sd = contiguous_state()
    engines = [Engine(sd), Engine(sd)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    for v in (1, 2, 3):
        for t in sd.values():
            t.add_(1)  # the trainer steps in place
        report = sender.push(sd.items(), version=v, timeout=30)
        assert report.plan_sent == (v == 1) and all(e.equals(sd) for e in engines)
    assert all(t.untyped_storage().is_shared() for t in sd.values() if t.numel())
    assert sender.statistics().buffer_bytes == 0  # no packing buffers
    assert [r.statistics().buffers_opened for r in rs] == [5, 5]  # a storage each, once
    for r in rs:
        r.close()


def test_a_push_of_the_tensors_pushed_last_is_started_by_the_pushing_thread(direct_sender):
    """The same tensors where they lay (as a dict, its items or a list) skip the wire loop's
    round trips; a tensor found elsewhere is read where it lies now."""
    sender = direct_sender
    sd = contiguous_state()
    engines = [Engine(sd), Engine(sd)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    forms = [sd.items(), sd, list(sd.items()), tuple(sd.items()), sd.items()]
    for v, named in enumerate(forms, 1):
        for t in sd.values():
            t.add_(1)
        sender.push(named, version=v, timeout=30)
        assert all(e.equals(sd) for e in engines), v
    stats = sender.statistics()
    here = stats.started_here
    assert here >= len(forms) - 2  # the first push plans, the second may still wait for one
    # each announced on the receivers' start lines (the hub answered none of their requests)
    assert stats.started_on_lines == here
    assert [r.statistics().version for r in rs] == [len(forms)] * 2
    moved = torch.randn(128, 256).share_memory_()  # w1 replaced: other memory, same shape
    sd["w1"] = moved
    sender.push(sd.items(), version=9, timeout=30)
    assert all(e.equals(sd) for e in engines) and sender.statistics().started_here == here
    moved.mul_(-1)
    sender.push(sd.items(), version=10, timeout=30)  # found where it lay now: from this thread
    assert all(e.equals(sd) for e in engines) and sender.statistics().started_here == here + 1
    for r in rs:
        r.close()


def test_new_tensors_where_the_last_pushs_lay_before_it_moved_them_are_pushed_themselves(
    direct_sender,
):
    """A push over shm moves tensors that are not in shared memory there; new tensors where
    they lay, holding other values, are pushed themselves, not the moved ones (same names,
    shapes, strides and dtypes: only where each lies now tells them apart)."""
    sender = direct_sender
    shapes = {f"w{i}": (128, 256) for i in range(4)}
    n = sum(a * b for a, b in shapes.values())

    def views(flat):
        out, at = {}, 0
        for k, (a, b) in shapes.items():
            out[k] = flat[at : at + a * b].view(a, b)
            at += a * b
        return out

    owner = np.random.default_rng(0).standard_normal(n, dtype=np.float32)  # keeps its memory
    flat = torch.from_numpy(owner)
    first = views(flat)
    engines = [Engine(first), Engine(first)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    sender.push(first.items(), version=1, timeout=30)
    assert flat.untyped_storage().is_shared() and flat.data_ptr() != owner.ctypes.data  # moved
    owner += 1  # other values where ``first`` lay at its push
    again = views(torch.from_numpy(owner))
    sender.push(again.items(), version=2, timeout=30)
    assert all(e.equals(again) for e in engines)
    for r in rs:
        r.close()


def test_a_push_whose_start_line_refuses_it_is_announced_through_the_hub(direct_sender):
    """A start line that cannot take a datagram (its queue full, say) leaves that receiver
    to the hub: its parked request is answered with the buckets, and the push commits."""
    sender = direct_sender
    sd = contiguous_state()
    engines = [Engine(sd), Engine(sd)]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    for v in (1, 2, 3):
        sender.push(sd.items(), version=v, timeout=30)
    starter = sender._pusher.parts.hub.starter
    lines, here = sender.statistics().started_on_lines, sender.statistics().started_here
    refused = {m.line for m in sender._pusher.parts.hub.members.values()}
    sent = starter.send
    starter.send = lambda name, data: "refused" if name in refused and data else sent(name, data)
    for v in (4, 5):
        for t in sd.values():
            t.add_(1)
        sender.push(sd.items(), version=v, timeout=30)
        assert all(e.equals(sd) for e in engines), v
    stats = sender.statistics()
    assert stats.started_here == here + 2 and stats.started_on_lines == lines
    assert [r.statistics().version for r in rs] == [5, 5]
    for r in rs:
        r.close()


def test_a_push_of_what_is_not_name_tensor_pairs_is_refused_naming_it():
    sender = WeightSender(group="rollout", transport="shm", receivers=1)
    sd = contiguous_state()
    engine = Engine(sd)
    r = start(sender, engine, "r0")
    fix = " (give a state_dict(), its .items(), or a list of (name, tensor) pairs)"
    for bad, got in (
        ({"w0": 3}, "(str, int)"),  # a dict of other values
        ([sd["w0"]], "Tensor"),  # tensors without their names
        ([("w0", "x")], "(str, str)"),
    ):
        with pytest.raises(WeightSyncError) as e:
            sender.push(bad, version=1, timeout=5)
        assert str(e.value) == (
            f"named_tensors[0]: expected a (str, torch.Tensor) pair, got {got}{fix}"
        )
    sender.push(sd, version=1, timeout=30)  # the state dict itself, pushed
    assert engine.equals(sd) and engine.commits == [1]
    r.close()
    sender.close()


def test_shm_zero_copy_moves_tensors_once_and_packs_other_tensors_not_shared(direct_sender):
    sender = direct_sender
    engines = [Engine(contiguous_state()), Engine(contiguous_state())]
    rs = [start(sender, e, f"r{i}") for i, e in enumerate(engines)]
    sender.push(contiguous_state(1).items(), version=1, timeout=30)
    fresh = contiguous_state(2)
    sender.push(fresh.items(), version=2, timeout=30)
    assert all(e.equals(fresh) for e in engines)
    assert not fresh["w0"].untyped_storage().is_shared()  # left where it was: packed
    assert sender.statistics().buffer_bytes > 0
    shared = contiguous_state(3)
    for t in shared.values():
        t.share_memory_()  # shared already: read in place, nothing moved
    sender.push(shared.items(), version=3, timeout=30)
    assert all(e.equals(shared) for e in engines) and sender.statistics().buffer_bytes == 0
    for r in rs:
        r.close()


def test_shm_zero_copy_reads_strided_views_where_they_lie():
    """Views of any strides (a trainer rank's columns of a row-parallel weight, a
    transposed tensor) are read in place, nothing packed, bit for bit."""
    sender = WeightSender(group="rollout", transport="shm", bucket_bytes=256 << 10)
    g = torch.Generator().manual_seed(3)
    base = {"o": torch.randn(64, 96, generator=g), "t": torch.randn(40, 24, generator=g)}
    views = {"o.cols": base["o"][:, 32:80], "t.T": base["t"].t(), "o.rows": base["o"][8:16]}
    assert not views["o.cols"].is_contiguous() and not views["t.T"].is_contiguous()
    engine = Engine(views)
    r = start(sender, engine, "r0")
    for v in (1, 2):
        for t in base.values():
            t.mul_(1.5)  # the trainer steps in place: the views see it
        sender.push(views.items(), version=v, timeout=30)
        assert engine.equals(views)
    assert sender.statistics().buffer_bytes == 0  # read in place: no packing buffer
    assert r.statistics().buffers_opened == 2  # the two storages, once
    r.close()
    sender.close()


def test_shm_zero_copy_off_packs_and_leaves_the_tensors_alone():
    s = WeightSender(group="rollout", transport="shm", bucket_bytes=256 << 10, zero_copy=False)
    sd = contiguous_state()
    e = Engine(sd)
    r = start(s, e, "r0")
    s.push(sd.items(), version=1, timeout=30)
    assert e.equals(sd) and not sd["w0"].untyped_storage().is_shared()
    r.close()
    s.close()


def test_cpu_buckets_grow_to_the_largest_tensor_so_none_is_split():
    from rlferry.weights.planning._buckets import default_bucket_bytes

    cpu, mib = torch.device("cpu"), 1 << 20
    assert default_bucket_bytes(cpu, 10 * mib) == 64 * mib
    assert default_bucket_bytes(cpu, 77_791_233) == 77_791_488  # raised, 256-byte aligned
    assert default_bucket_bytes(cpu, 2048 * mib) == 64 * mib  # too large: split


def test_a_push_whose_next_step_blocks_waits_until_every_other_push_enqueued_its_own():
    # one thread drives a rank's NCCL links: a link blocking on its sends while another
    # link's buckets were not yet enqueued hung updates (their receivers waited on them)
    from rlferry.weights.sender._turns import take_turns

    order: list[str] = []

    def link(name, buckets):
        for k in range(buckets):
            order.append(f"{name}{k}")
            yield  # a bucket enqueued
        yield True  # next: wait for the sends
        order.append(f"{name} sent")
        yield True  # next: wait for the commits
        order.append(f"{name} committed")
        return name

    reports: dict[int, str] = {}
    take_turns({0: link("a", 1), 1: link("b", 3)}, reports, {})
    assert order == [
        "a0", "b0", "b1", "b2", "a sent", "b sent", "a committed", "b committed",
    ]  # fmt: skip
    assert reports == {0: "a", 1: "b"}


def test_zero_copy_strides_that_reach_past_the_senders_memory_are_refused():
    from rlferry.weights.copies._pack import Unpacker

    t = torch.randn(4, 6)
    plan = Plan.build([TensorSpec("w", (6, 4), torch.float32)], 1 << 20)
    raw = t.view(-1).view(torch.uint8)
    u = Unpacker.direct(plan, [raw], [[1, 6]])  # the transpose, read where it lies
    assert torch.equal(u.loads[0][0][1], t.t())
    with pytest.raises(WeightSyncError, match=r"tensor `w` reaches 120 bytes, the memory shared "
                       r"holds 96 from it"):  # fmt: skip
        Unpacker.direct(plan, [raw], [[1, 8]])
    with pytest.raises(WeightSyncError, match=r"tensor `w`: 1 strides for shape \[6, 4\]"):
        Unpacker.direct(plan, [raw], [[1]])
