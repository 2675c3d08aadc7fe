"""GPU transports, on the device machine: cuda_ipc on one GPU and across two, NCCL broadcast
on two.

Skipped on CPU (with the reason); run there with `python -m pytest -q tests/test_weights_gpu.py`.
"""

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from conftest import requires_cuda
from rlferry.weights import (
    ShardedReceiver,
    ShardedSender,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    fsdp_layout,
    tp_layout,
)
from rlferry.weights.planning import ShardPlan
from rlferry.weights.planning._boxes import slices
from rlferry.weights.transports._cuda_shared import open_shared, share
from test_weights_sharded import kill_a_trainer_rank_mid_stream
from test_weights_sharded_plan import expected_params, full_weights, llama_specs

pytestmark = [requires_cuda, pytest.mark.gpu]

requires_2_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (runs on nvidia-h200-x2)",
)
requires_3_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 3,
    reason="needs 3 CUDA GPUs (runs on nvidia-h100-x4)",
)


def weights(seed, device="cuda:0", big=False, strided=False):
    if strided:  # and views of them a trainer rank pushes: columns of each layer, a transpose
        sd = weights(seed, device)
        for i in range(8):
            sd[f"layers.{i}.w.cols"] = sd[f"layers.{i}.w"][:, 256:768]
        sd["embed.t"] = sd["embed"].t()
        return sd
    g = torch.Generator(device=device).manual_seed(seed)
    if big:  # 368 MiB: large tensors at both ends, small ones between (ramped buckets)
        sd = {"embed": torch.randn(16384, 2048, device=device, generator=g).bfloat16()}
        for i in range(12):
            sd[f"layers.{i}.a"] = torch.randn(1024, 1024, device=device, generator=g)
            sd[f"layers.{i}.b"] = torch.randn(4096, 2048, device=device, generator=g).bfloat16()
            sd[f"layers.{i}.norm"] = torch.randn(1024, device=device, generator=g)
        sd["head"] = torch.randn(16384, 2048, device=device, generator=g).bfloat16()
        return sd
    sd = {f"layers.{i}.w": torch.randn(512, 1024, device=device, generator=g) for i in range(8)}
    sd["embed"] = torch.randn(4096, 1024, device=device, generator=g).bfloat16()  # 8 MiB
    sd["norm"] = torch.randn(1024, device=device, generator=g)
    sd["step"] = torch.tensor(3, device=device)
    return sd


def digest(sd):
    """Exact: an integer sum of each tensor's bytes."""
    return {n: int(t.reshape(-1).view(torch.uint8).sum(dtype=torch.int64)) for n, t in sd.items()}


def _engine(
    address, group, device, conn, fail_at, verify, secret, name, big, hang_at=0, strided=False
):
    torch.cuda.set_device(device)
    like = weights(0, device, big, strided)
    params = {n: torch.zeros_like(t) for n, t in like.items()}
    calls = []

    def load(items):
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("engine refused")
        if len(calls) == hang_at:
            conn.send("loading")
            threading.Event().wait()  # killed here, mid-push
        for n, t in items:
            params[n].copy_(t)

    def on_commit(version):
        conn.send(("commit", version, digest(params), r.statistics().buffers_opened))

    r = WeightReceiver(group=group, address=address, load=load, on_commit=on_commit,
                       device=device, verify=verify, name=name or f"engine-{device}",
                       secret=secret)  # fmt: skip
    r.start(timeout=120)
    conn.send("ready")
    conn.recv()
    r.close()


def spawn(
    address, group, device, fail_at=0, verify=True, secret=None, name=None, big=False, hang_at=0,
    strided=False,
):  # fmt: skip
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (address, group, device, child, fail_at, verify, secret, name, big, hang_at, strided)
    p = ctx.Process(target=_engine, args=args, daemon=True)
    p.start()
    assert parent.poll(180) and parent.recv() == "ready"
    return p, parent


@pytest.mark.parametrize("bucket", [1 << 20, 64 << 20])  # split tensors, or none
def test_cuda_ipc_packed_delivers_exact_values_and_opens_the_buffers_once(bucket):
    s = WeightSender(
        group="ipc", transport="cuda_ipc", receivers=1, bucket_bytes=bucket, zero_copy=False
    )
    proc, conn = spawn(s.address, "ipc", "cuda:0")
    for v in (1, 2, 3):
        sd = weights(v)
        report = s.push(sd.items(), version=v, timeout=120)
        assert report.receivers == ("engine-cuda:0",)
        kind, version, got, opened = conn.recv()
        assert (kind, version, opened) == ("commit", v, 2)
        assert got == digest(sd)
    conn.send("stop")
    proc.join(60)
    s.close()


def test_cuda_ipc_zero_copy_opens_the_pushed_tensors_once_while_they_stay_the_same():
    s = WeightSender(group="ipc", transport="cuda_ipc", receivers=1, bucket_bytes=1 << 20)
    proc, conn = spawn(s.address, "ipc", "cuda:0", verify=False)  # verify packs: it sums buckets
    sd = weights(1)
    opened = []
    for v in (1, 2, 3):
        for t in sd.values():
            t.add_(1)  # the trainer's step: same tensors, new values
        assert s.push(sd.items(), version=v, timeout=120).receivers == ("engine-cuda:0",)
        kind, version, got, n = conn.recv()
        assert (kind, version, got) == ("commit", v, digest(sd))
        opened.append(n)
    assert opened == [len(sd)] * 3  # one export per tensor storage, opened on the first push
    assert s.statistics().buffer_bytes == 0  # no packing buffers
    other = weights(9)  # other tensors: exported and opened anew
    s.push(other.items(), version=4, timeout=120)
    assert conn.recv()[:3] == ("commit", 4, digest(other))
    conn.send("stop")
    proc.join(60)
    s.close()


def test_cuda_ipc_a_failing_engine_is_named_and_the_next_push_works():
    s = WeightSender(group="ipc", transport="cuda_ipc", receivers=1, bucket_bytes=1 << 20)
    proc, conn = spawn(s.address, "ipc", "cuda:0", fail_at=2, verify=False)
    with pytest.raises(WeightSyncError) as e:
        s.push(weights(1).items(), version=1, timeout=120)
    assert e.value.failures["engine-cuda:0"].startswith("load raised RuntimeError: engine refused")
    sd = weights(2)
    s.push(sd.items(), version=2, timeout=120)
    assert conn.recv()[:3] == ("commit", 2, digest(sd))
    conn.send("stop")
    proc.join(60)
    s.close()


@requires_2_gpus
def test_nccl_broadcast_to_another_gpu_delivers_exact_values_and_reuses_the_group():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    s = WeightSender(group="nccl", transport="broadcast", receivers=1, bucket_bytes=1 << 20)
    proc, conn = spawn(s.address, "nccl", "cuda:1")
    for v in (1, 2):
        sd = weights(v)
        s.push(sd.items(), version=v, timeout=120)
        kind, version, got, _ = conn.recv()
        assert (kind, version) == ("commit", v)
        assert got == digest(sd)
    assert s.statistics().groups_formed == 1
    conn.send("stop")
    proc.join(60)
    s.close()


@requires_2_gpus
def test_nccl_broadcast_of_a_large_push_in_ramped_buckets_delivers_exact_values():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    s = WeightSender(group="ramp", transport="broadcast", receivers=1, bucket_bytes=512 << 20)
    proc, conn = spawn(s.address, "ramp", "cuda:1", verify=False, big=True)
    for v in (1, 2, 3):  # the plan's first push, then the grouped copies' build and use
        sd = weights(v, big=True)
        report = s.push(sd.items(), version=v, timeout=120)
        kind, version, got, _ = conn.recv()
        assert (kind, version, got) == ("commit", v, digest(sd))
    nbytes = sum(t.nbytes for t in sd.values())
    # small buckets at both ends: more of them than the model's bytes in full buckets
    assert report.buckets > -(-nbytes // (512 << 20)) + 2
    conn.send("stop")
    proc.join(60)
    s.close()


def test_cuda_ipc_zero_copy_reaches_two_engines_on_one_gpu():
    s = WeightSender(group="ipc", transport="cuda_ipc", receivers=2, bucket_bytes=1 << 20)
    engines = [spawn(s.address, "ipc", "cuda:0", verify=False, name=f"e{i}") for i in range(2)]
    sd = weights(1)
    for v in (1, 2):
        for t in sd.values():
            t.add_(1)
        assert s.push(sd.items(), version=v, timeout=120).receivers == ("e0", "e1")
        for _, conn in engines:
            assert conn.recv()[:3] == ("commit", v, digest(sd))
    for proc, conn in engines:
        conn.send("stop")
        proc.join(60)
    s.close()


@requires_2_gpus
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "packed"])
def test_cuda_ipc_an_engine_on_another_gpu_reads_the_trainers_memory_across(zero_copy):
    """The engine opens the trainer's memory onto its own GPU (peer access) and its loads
    read it there: the tensors themselves, strided views included (zero copy), or the
    bucket buffers (packed, the events ordering packs and loads across the two GPUs)."""
    s = WeightSender(
        group="ipc-peer", transport="cuda_ipc", receivers=1, bucket_bytes=1 << 20,
        zero_copy=zero_copy, device="cuda:0",
    )  # fmt: skip
    proc, conn = spawn(s.address, "ipc-peer", "cuda:1", verify=False, strided=True)
    sd = weights(1, strided=True)
    opened = []
    for v in (1, 2, 3):
        for n, t in sd.items():
            if t.is_floating_point() and not n.endswith((".cols", ".t")):
                t.add_(1)  # the trainer's step, in place: its views see it
        assert s.push(sd.items(), version=v, timeout=120).receivers == ("engine-cuda:1",)
        kind, version, got, n = conn.recv()
        assert (kind, version, got) == ("commit", v, digest(sd))
        opened.append(n)
    storages = len({t.untyped_storage().data_ptr() for t in sd.values()})
    assert opened == [storages if zero_copy else 2] * 3  # opened on the first push only
    assert (s.statistics().buffer_bytes == 0) == zero_copy
    conn.send("stop")
    proc.join(60)
    s.close()


@requires_2_gpus
def test_nccl_broadcast_with_a_secret_meets_over_the_control_channel():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    secret = "a shared secret of 32 bytes long"
    s = WeightSender(group="nccl", transport="broadcast", receivers=1, bucket_bytes=1 << 20,
                     bind="tcp://127.0.0.1:*", secret=secret)  # fmt: skip
    proc, conn = spawn(s.address, "nccl", "cuda:1", secret=secret)
    for v in (1, 2):
        sd = weights(v)
        s.push(sd.items(), version=v, timeout=120)
        assert conn.recv()[:3] == ("commit", v, digest(sd))
    assert s.statistics().groups_formed == 1 and s._pusher.parts.transport.store_address is None
    conn.send("stop")
    proc.join(60)
    s.close()


@requires_3_gpus
def test_nccl_an_engine_killed_mid_push_fails_it_at_once_and_the_others_take_the_next():
    """The dead engine's peers would wait for it until NCCL's timeout, and torch's watchdog
    would then take their processes down: the sender aborts the group when it hears the
    engine left, the surviving engine's watch aborts its side, every process lives."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    s = WeightSender(group="kill", transport="broadcast", receivers=2, bucket_bytes=1 << 20)
    steady, steady_conn = spawn(s.address, "kill", "cuda:1", verify=False, name="steady")
    dying, dying_conn = spawn(s.address, "kill", "cuda:2", verify=False, name="dying", hang_at=2)
    result = {}

    def push():
        try:
            s.push(weights(1).items(), version=1, timeout=120)
        except WeightSyncError as e:
            result["error"] = e
        result["at"] = time.monotonic()

    t = threading.Thread(target=push)
    t.start()
    assert dying_conn.poll(120) and dying_conn.recv() == "loading"
    killed = time.monotonic()
    os.kill(dying.pid, signal.SIGKILL)
    t.join(150)
    e = result["error"]
    print(f"the push failed {result['at'] - killed:.2f} s after the kill")
    assert "disconnected (its process died or it closed its receiver)" in e.failures["dying"]
    assert result["at"] - killed < 20  # at once, not at the group's 120 s timeout
    sd = weights(2)
    t0 = time.monotonic()
    assert s.push(sd.items(), version=2, timeout=120).receivers == ("steady",)
    print(f"the next push took {time.monotonic() - t0:.2f} s")
    msg = steady_conn.recv()  # version 1 was aborted everywhere: its first commit is 2
    assert msg[:3] == ("commit", 2, digest(sd))
    steady_conn.send("stop")
    steady.join(60)
    assert steady.exitcode == 0
    s.close()


def _trainer(conn, device):
    torch.cuda.set_device(device)
    s = WeightSender(group="dies", transport="broadcast", receivers=1, bucket_bytes=1 << 20)
    conn.send(s.address)
    s.push(weights(1, device).items(), version=1, timeout=120)
    conn.send("pushed")
    conn.recv()
    s.push(weights(2, device).items(), version=2, timeout=120)  # killed in it
    threading.Event().wait()


@requires_2_gpus
def test_nccl_a_trainer_killed_mid_push_leaves_the_engine_serving_its_last_version():
    """The engine's NCCL wait would last until the group's timeout, and torch's watchdog
    would then take the engine down: its watch sees the sender's connection go and aborts
    its side of the group; the engine stays at version 1 and says why it stopped."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    trainer = ctx.Process(target=_trainer, args=(child, "cuda:1"), daemon=True)
    trainer.start()
    assert conn.poll(180)
    address = conn.recv()
    torch.cuda.set_device("cuda:0")
    params = {n: torch.zeros_like(t) for n, t in weights(0, "cuda:0").items()}
    armed, loading, go_on = threading.Event(), threading.Event(), threading.Event()

    def load(items):
        if armed.is_set() and not loading.is_set():  # version 2, mid-stream: killed now
            loading.set()
            go_on.wait(60)
        for n, t in items:
            params[n].copy_(t)

    r = WeightReceiver(group="dies", address=address, load=load, device="cuda:0", name="e")
    r.start(timeout=120)
    assert r.wait_for(1, timeout=120) is True
    assert conn.recv() == "pushed"
    armed.set()
    conn.send("push version 2")
    assert loading.wait(120)
    os.kill(trainer.pid, signal.SIGKILL)
    killed = time.monotonic()
    go_on.set()
    with pytest.raises(WeightSyncError) as e:
        r.wait_for(2, timeout=60)
    print(f"the engine stopped waiting {time.monotonic() - killed:.2f} s after the kill")
    assert time.monotonic() - killed < 20  # at once, not at the group's 120 s timeout
    assert "went away" in str(e.value)
    assert r.version == 1  # what it serves is version 1's (its load wrote in place)
    r.close()


@requires_3_gpus
def test_nccl_an_engine_stuck_mid_push_fails_it_at_its_timeout_and_no_process_goes_down():
    """A peer that lives but never finishes: the push ends at its timeout, where torch's
    watchdog aborts the group (rlferry's groups are made so that it does not take the
    process down, its default); the engine that was fine is told and lives on."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    s = WeightSender(group="stuck", transport="broadcast", receivers=2, bucket_bytes=1 << 20)
    steady, steady_conn = spawn(s.address, "stuck", "cuda:1", verify=False, name="steady")
    stuck, stuck_conn = spawn(s.address, "stuck", "cuda:2", verify=False, name="stuck", hang_at=2)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as e:
        s.push(weights(1).items(), version=1, timeout=20)
    print(f"the push failed after {time.monotonic() - t0:.2f} s: {e.value}")
    assert time.monotonic() - t0 < 60
    assert e.value.failures == {"stuck": "did not finish within the push's timeout"}
    assert stuck_conn.recv() == "loading"
    assert steady.is_alive() and stuck.is_alive()
    steady_conn.send("stop")
    steady.join(60)
    assert steady.exitcode == 0
    stuck.kill()
    s.close()


@requires_2_gpus
def test_nccl_a_trainer_rank_killed_mid_stream_of_a_point_to_point_push_fails_by_name():
    """The CPU test of a trainer rank killed mid-stream, over NCCL: both trainer ranks on
    GPU 0, both ranks of a TP=2 engine on GPU 1, each link its own group of two. The
    engine ranks' waits on the device end by their watches, not NCCL's timeout."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    kill_a_trainer_rank_mid_stream("broadcast", "cuda:0", "cuda:1")


def _writing_trainer(rank, device, conn):
    """A trainer rank over cuda_ipc, point to point: its shards stay where they are, a
    version's values copied into them (as an optimizer steps in place)."""
    torch.cuda.set_device(device)
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    trainer, engine = fsdp_layout(specs, 2), tp_layout(specs, 2)
    s = ShardedSender(
        group="writes", rank=rank, trainer=trainer, engine=engine, transport="cuda_ipc",
        point_to_point=True, device=device,
    )  # fmt: skip
    conn.send(s.addresses)
    mine = None
    while (msg := conn.recv()) != "stop":
        v, timeout = msg if isinstance(msg, tuple) else (msg, 120.0)
        full = full_weights(specs, v)
        ours = {n: full[n][slices(b)] for n, b in trainer.owned[rank].items()}
        if mine is None:
            mine = {n: t.to(device, copy=True) for n, t in ours.items()}
        if v == 5:  # two tensors' storages swapped: the bytes written ahead are the old ones
            for n in list(mine)[:2]:
                mine[n].data = torch.empty_like(mine[n])
        for n, t in ours.items():
            mine[n].copy_(t)
        try:
            s.push(mine, version=v, timeout=timeout)
            conn.send(("pushed", v))
        except WeightSyncError as e:
            conn.send(("error", str(e), list(e.failures)))
    s.close()


def _written_engine(rank, device, addresses, conn):
    """An engine rank with no hook around its loads: its trainer ranks write into it."""
    torch.cuda.set_device(device)
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    trainer, engine = fsdp_layout(specs, 2), tp_layout(specs, 2)
    params = {n: torch.zeros(s.shape, dtype=s.dtype, device=device)
              for n, s in engine.param_specs(rank).items()}  # fmt: skip
    r = ShardedReceiver(
        group="writes", rank=rank, trainer=trainer, engine=engine, params=params,
        addresses=addresses, point_to_point=True, device=device,
    ).start(120)  # fmt: skip
    conn.send("ready")
    while (v := conn.recv()) != "stop":
        assert r.wait_for(v, 120)
        want = expected_params(engine, rank, full_weights(specs, v))
        same = all(torch.equal(params[n].cpu(), want[n]) for n in want)
        links = {s: (x.bytes_written, x.bytes_loaded) for s, x in r.statistics().links.items()}
        conn.send((r.version, same, links))
    r.close()


def _start(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, child), daemon=True)
    p.start()
    return p, parent


def _answer(conn):
    assert conn.poll(180), "a child process did not answer"
    return conn.recv()


@requires_2_gpus
def test_cuda_ipc_trainer_ranks_write_each_update_into_the_engine_ranks_tensors():
    """Two trainer ranks on GPU 0, the two ranks of a TP=2 engine on GPU 1 (four GPUs: a GPU
    each), point to point over cuda_ipc: each engine rank offers its tensors, each trainer
    rank's GPU writes its pieces there (strided columns of row-parallel weights too), the
    engine loads nothing; bit for bit over six updates (from the third on the same
    tensors are written ahead of their checks; before the fifth two of them move, and their
    new bytes follow); an engine rank killed between updates fails only its links' part of
    the next push (no receiver comes within its timeout), the other engine rank commits
    it, and no trainer process goes down."""
    four = torch.cuda.device_count() >= 4
    tdev = [f"cuda:{r}" if four else "cuda:0" for r in range(2)]
    edev = [f"cuda:{2 + r}" if four else "cuda:1" for r in range(2)]
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    plan = ShardPlan.build(fsdp_layout(specs, 2), tp_layout(specs, 2))
    trainers = [_start(_writing_trainer, r, tdev[r]) for r in range(2)]
    addresses = [_answer(c) for _, c in trainers]
    engines = [_start(_written_engine, r, edev[r], addresses) for r in range(2)]
    try:
        assert [_answer(c) for _, c in engines] == ["ready", "ready"]
        for v in range(1, 7):
            for _, c in trainers:
                c.send(v)
            assert [_answer(c) for _, c in trainers] == [("pushed", v)] * 2
            for _, c in engines:
                c.send(v)
            for r, (_, c) in enumerate(engines):
                version, same, links = _answer(c)
                assert (version, same) == (v, True)
                # every byte written by the trainer ranks' GPUs, none loaded by the engine
                assert links == {s: (v * plan.link_bytes(s, r), 0) for s in range(2)}
        engines[0][0].kill()
        engines[0][0].join(30)
        for _, c in trainers:
            c.send((7, 5.0))  # its link to the dead rank waits 5 s for a receiver
        for _, c in trainers:
            kind, msg, _ = _answer(c)
            assert kind == "error" and "within 5 s" in msg, msg
        engines[1][1].send(7)
        assert _answer(engines[1][1])[:2] == (7, True)
        assert all(p.is_alive() for p, _ in trainers)
    finally:
        for p, c in [*engines, *trainers]:
            if p.is_alive():
                c.send("stop")
        for p, _ in [*engines, *trainers]:
            p.join(60)


def _exporter(device, conn):
    torch.cuda.set_device(device)
    t = torch.zeros(1 << 20, device=device)
    conn.send(share(t))
    conn.recv()  # killed here


@requires_2_gpus
def test_cuda_ipc_memory_of_a_dead_process_written_across_leaves_the_writer_working():
    """What a trainer's write into an engine that died meanwhile does: the memory it opened
    stays mapped (CUDA frees it when the last process lets go), the write lands there,
    and the writer's GPU goes on working."""
    p, c = _start(_exporter, "cuda:1")
    fields = _answer(c)
    with torch.cuda.device(0):
        mem = open_shared(fields, 0)  # the engine's memory, opened onto the trainer's GPU
    p.kill()
    p.join(30)
    mem.view(torch.float32).fill_(1.0)
    torch.cuda.synchronize(0)
    assert mem.view(torch.float32).sum().item() == 1 << 20
    assert torch.ones(4, device="cuda:0").sum().item() == 4
