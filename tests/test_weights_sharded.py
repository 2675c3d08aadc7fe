"""Many senders to many receivers over shm, in real processes: FSDP2 trainers over gloo,
engine ranks that take their tensor-parallel slices, a trainer rank that dies."""

import functools
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Mapping

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
from rlferry.weights.planning import EngineLayout, ShardPlan, TrainerLayout, dtensor_layout
from rlferry.weights.planning._boxes import slices
from rlferry.weights.planning._budget import link_ctas
from rlferry.weights.sender._turns import drain
from test_weights_sharded_plan import expected_params, full_weights, llama_specs

CTX = mp.get_context("spawn")
WAIT = 120


def engine_layout(kind, specs):
    if kind == "replicas":  # two engines of one rank each: both need every tensor whole
        return EngineLayout.whole(specs, receivers=2)
    if kind == "tp2-bf16":
        return tp_layout(specs, 2, dtype=torch.bfloat16)
    return tp_layout(specs, 2)


class TinyLlama(torch.nn.Module):
    """Llama's parameter names (what tp_layout knows), a few layers of width 64."""

    def __init__(self, layers=2, hidden=64, inter=128, vocab=96, kv=32):
        super().__init__()
        lin = torch.nn.Linear
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.model.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            a = layer.self_attn
            a.q_proj, a.k_proj, a.v_proj = (
                lin(hidden, hidden),
                lin(hidden, kv, False),
                lin(hidden, kv, False),
            )
            a.o_proj = lin(hidden, hidden, False)
            layer.mlp = torch.nn.Module()
            m = layer.mlp
            m.gate_proj, m.up_proj = lin(hidden, inter, False), lin(hidden, inter, False)
            m.down_proj = lin(inter, hidden, False)
            layer.input_layernorm = torch.nn.RMSNorm(hidden)
            self.model.layers.append(layer)
        self.model.norm = torch.nn.RMSNorm(hidden)
        self.lm_head = lin(hidden, vocab, False)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            h = layer.input_layernorm(x)
            kv = a.k_proj(h) * a.v_proj(h)
            x = x + a.o_proj(a.q_proj(h) * kv.repeat(1, 1, 2))
            x = x + m.down_proj(torch.nn.functional.silu(m.gate_proj(x)) * m.up_proj(x))
        return self.lm_head(self.model.norm(x))


def _fsdp_trainer(rank, world, kind, tmp, conn):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/group", rank=rank, world_size=world
    )  # a file rendezvous: no port for another process to take first
    torch.manual_seed(0)
    model = TinyLlama()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))  # not CUDA's, if one is seen
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sd = model.state_dict()
    trainer = dtensor_layout(sd.items())
    specs = specs_of(sd.items())
    same = trainer.fingerprint == fsdp_layout(specs, world).fingerprint
    s = ShardedSender(
        group="fsdp", rank=rank, trainer=trainer, engine=engine_layout(kind, specs),
        bucket_bytes=64 << 10,
    )  # fmt: skip
    conn.send((s.address, specs, same, trainer.owned_bytes(rank)))
    while (msg := conn.recv()) != "stop":
        v = msg
        g = torch.Generator().manual_seed(v)
        loss = model(torch.randint(0, 96, (2, 8), generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sd = model.state_dict()
        full = {n: t.full_tensor() for n, t in sd.items()}  # the reference (a collective)
        if rank == 0:
            torch.save(full, os.path.join(tmp, f"v{v}.pt"))
        dist.barrier()
        report = s.push(sd, version=v, timeout=WAIT)
        st = s.statistics()
        conn.send((report.bytes, st.plans_computed, st.stream_bytes, st.link.bytes_pushed))
    s.close()
    dist.destroy_process_group()


def _engine(rank, world, kind, specs, addresses, tmp, conn):
    """An engine rank: holds its parameters, reports each version and whether it is exact."""
    trainer = fsdp_layout(specs, world)
    engine = engine_layout(kind, specs)
    params = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in engine.param_specs(rank).items()}
    r = ShardedReceiver(
        group="fsdp" if tmp else "ex", rank=rank, trainer=trainer, engine=engine, params=params,
        addresses=addresses, name=f"engine{rank}",
    ).start(WAIT)  # fmt: skip
    conn.send("ready")
    while (msg := conn.recv()) != "stop":
        cmd, arg = msg
        try:
            if cmd == "connect":
                r.connect(*arg, timeout=WAIT)
                conn.send("connected")
                continue
            if cmd == "layout":
                engine = engine_layout(arg, specs)
                new = engine.param_specs(rank).items()
                params = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in new}
                r.set_layouts(engine=engine, params=params)
                conn.send("relaid")
                continue
            assert r.wait_for(arg, WAIT)
        except WeightSyncError as e:
            conn.send(("error", str(e), e.failures, r.version))
            continue
        if tmp:
            full = torch.load(os.path.join(tmp, f"v{arg}.pt"), weights_only=True)
        else:
            full = full_weights(specs, arg)
        want = expected_params(engine, rank, full)
        same = params.keys() == want.keys() and all(torch.equal(params[n], want[n]) for n in want)
        st = r.statistics()
        conn.send(("at", r.version, same, st.plans_computed, sorted(st.links)))
    r.close()


def start(target, *args):
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent


def recv(conn):
    assert conn.poll(WAIT), "a child process did not answer"
    return conn.recv()


def stop(*pairs):
    for proc, conn in pairs:
        if proc.is_alive():
            conn.send("stop")
    for proc, _ in pairs:
        proc.join(30)


@pytest.mark.slow
def test_four_fsdp2_ranks_to_two_engines_each_sends_only_its_shards_and_the_plan_once(tmp_path):
    tmp = str(tmp_path)
    trainers = [start(_fsdp_trainer, r, 4, "replicas", tmp) for r in range(4)]
    hello = [recv(c) for _, c in trainers]
    addresses = [h[0] for h in hello]
    specs = hello[0][1]
    assert all(h[2] for h in hello)  # the DTensors' layout is FSDP2's torch.chunk rows
    model_bytes = sum(s.nbytes for s in specs)
    engines = [start(_engine, r, 4, "replicas", specs, addresses, tmp) for r in range(2)]
    assert [recv(c) for _, c in engines] == ["ready", "ready"]
    try:
        for v in range(1, 6):
            for _, c in trainers:
                c.send(v)
            pushed = [recv(c) for _, c in trainers]
            for _, c in engines:
                c.send(("wait", v))
            for _, c in engines:
                assert recv(c) == ("at", v, True, 1, [0, 1, 2, 3])  # exact; one plan
            for (sent, plans, stream, total), h in zip(pushed, hello, strict=True):
                assert plans == 1
                assert sent == stream == h[3] < model_bytes  # what it owns, once for both
                assert total == v * h[3]
        assert sum(h[3] for h in hello) == model_bytes
    finally:
        stop(*engines, *trainers)


class _Hang(Mapping):
    """A state dict whose reading never ends: a trainer rank stuck mid-update."""

    def __init__(self, conn):
        self.conn = conn

    def __getitem__(self, key):
        raise KeyError(key)

    def __len__(self):
        return 0

    def __iter__(self):
        self.conn.send("hanging")
        threading.Event().wait()
        return iter(())


def _explicit_trainer(rank, world, kind, receivers, conn):
    """A trainer rank holding its rows of ``full_weights(version)`` as plain tensors."""
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    trainer = fsdp_layout(specs, world)
    s = ShardedSender(
        group="ex", rank=rank, trainer=trainer, engine=engine_layout(kind, specs),
        receivers=receivers, bucket_bytes=16 << 10,
    )  # fmt: skip
    conn.send(s.address)
    while (msg := conn.recv()) != "stop":
        cmd, v = msg
        if cmd == "layout":
            s.set_layouts(engine=engine_layout(v, specs))
            conn.send("relaid")
            continue
        if cmd == "hang":
            s.push(_Hang(conn), version=v, timeout=WAIT)
        full = full_weights(specs, v)
        mine = {n: full[n][slices(b)].clone() for n, b in trainer.owned[rank].items()}
        report = s.push(mine, version=v, timeout=WAIT)
        st = s.statistics()
        conn.send((report.bytes, st.plans_computed, st.stream_bytes))
    s.close()


def push_all(trainers, v):
    for _, c in trainers:
        c.send(("push", v))
    return [recv(c) for _, c in trainers]


def at(engines, v):
    for _, c in engines:
        c.send(("wait", v))
    return [recv(c) for _, c in engines]


@pytest.mark.slow
def test_two_ranks_to_a_tp2_engine_late_joiner_dead_rank_and_layout_change():
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    trainers = [start(_explicit_trainer, r, 2, "tp2", 1) for r in range(2)]
    addresses = [recv(c) for _, c in trainers]
    engines = [start(_engine, 0, 2, "tp2", specs, addresses, "")]
    assert recv(engines[0][1]) == "ready"
    replacement = None
    try:
        # fused qkv / gate_up slices, bit for bit; each rank sends half the bytes
        pushed = push_all(trainers, 1)
        assert at(engines, 1) == [("at", 1, True, 1, [0, 1])]
        model_bytes = sum(s.nbytes for s in specs)
        assert [p[0] for p in pushed] == [p[2] for p in pushed]
        assert sum(p[0] for p in pushed) == model_bytes  # the plan's: both engine ranks' slices
        # a receiver that joins later gets the plan with the next update
        engines.append(start(_engine, 1, 2, "tp2", specs, addresses, ""))
        assert recv(engines[1][1]) == "ready"
        pushed = push_all(trainers, 2)
        assert at(engines, 2) == [("at", 2, True, 1, [0, 1])] * 2
        assert sum(p[0] for p in pushed) == model_bytes  # both halves now, each byte once
        # trainer rank 1 dies mid-update: rank 0's part arrived, rank 1's never will
        trainers[0][1].send(("push", 3))
        trainers[1][1].send(("hang", 3))
        assert recv(trainers[1][1]) == "hanging"
        recv(trainers[0][1])
        os.kill(trainers[1][0].pid, signal.SIGKILL)
        for (_, c), r in zip(engines, (0, 1), strict=True):
            c.send(("wait", 3))
            kind, msg, failures, version = recv(c)
            assert kind == "error" and version == 2  # its last whole version
            assert list(failures) == ["trainer rank 1"]
            assert msg.startswith(
                f"receiver `engine{r}` (engine rank {r}) cannot reach version 3: trainer rank 1: "
                "the sender at "
            )
            assert "went away (it closed or died)" in msg
            assert msg.endswith("it stays at version 2 (join a dead rank's replacement by connect)")
        # its replacement joins; the next update works
        replacement = start(_explicit_trainer, 1, 2, "tp2", 2)
        address = recv(replacement[1])
        for _, c in engines:
            c.send(("connect", (1, address)))
            assert recv(c) == "connected"
        trainers[1] = replacement
        push_all(trainers, 4)
        assert at(engines, 4) == [("at", 4, True, 1, [0, 1])] * 2
        # a layout change (the engine now serves bf16): the plan is computed again
        for _, c in [*trainers, *engines]:
            c.send(("layout", "tp2-bf16"))
            assert recv(c) == "relaid"
        pushed = push_all(trainers, 5)
        assert at(engines, 5) == [("at", 5, True, 2, [0, 1])] * 2
        assert [p[1] for p in pushed] == [2, 2]
        assert sum(p[0] for p in pushed) == model_bytes // 2  # cast to bf16 on the sender
    finally:
        stop(*engines, *trainers)


@pytest.mark.parametrize("ranks", [1, 2])
def test_one_sender_is_the_same_code_one_weight_sender_and_one_weight_receiver(ranks):
    """N = 1 through the sharded API: exactly one link, whole tensors under their names."""
    specs = llama_specs()
    trainer = TrainerLayout.single(specs) if ranks == 1 else fsdp_layout(specs, ranks)
    engine = EngineLayout.whole(specs)
    senders = [
        ShardedSender(group="one", rank=r, trainer=trainer, engine=engine) for r in range(ranks)
    ]
    params = {s.name: torch.zeros(s.shape) for s in specs}
    recv_ = ShardedReceiver(
        group="one", rank=0, trainer=trainer, engine=engine, params=params,
        addresses=[s.address for s in senders],
    ).start()  # fmt: skip
    try:
        for v in (1, 2):
            full = full_weights(specs, v)
            threads = []
            for r, s in enumerate(senders):
                mine = {n: full[n][slices(b)].clone() for n, b in trainer.owned[r].items()}
                t = threading.Thread(target=s.push, args=(mine,), kwargs={"version": v})
                t.start()
                threads.append(t)
            for t in threads:
                t.join(WAIT)
            assert recv_.wait_for(v, WAIT)
            assert all(torch.equal(params[n], full[n]) for n in full)
        st = recv_.statistics()
        assert sorted(st.links) == list(range(ranks)) and st.version == 2
        if ranks == 1:
            assert [p.name for p in senders[0].plan().streams[0]] == [s.name for s in specs]
            assert st.links[0].commits == 2 and senders[0].statistics().link.pushes == 2
    finally:
        recv_.close()
        for s in senders:
            s.close()


def _p2p_trainer(rank, transport, conn, device="cpu"):
    if device != "cpu":
        torch.cuda.set_device(device)
    if transport == "mixed":  # each rank its own way: the one beside the engines by memory
        transport = "shm" if rank == 0 else "broadcast"
    zero_copy = transport != "shm-packed"  # through the buffers, bucket by bucket
    transport = transport.removesuffix("-packed")
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    trainer, engine = fsdp_layout(specs, 2), tp_layout(specs, 2)
    s = ShardedSender(
        group="p2p", rank=rank, trainer=trainer, engine=engine, transport=transport,
        bucket_bytes=16 << 10, point_to_point=True, zero_copy=zero_copy,
    )  # fmt: skip
    conn.send(s.addresses)
    # on a GPU one thread takes the links' steps in turn: the first link held holds all
    armed = _held_at_bucket(1, 1 if device != "cpu" else len(s.addresses), conn)
    while (v := conn.recv()) != "stop":
        if v == "hold":  # the next push stops mid-stream (see _held_at_bucket)
            armed.set()
            continue
        full = full_weights(specs, v)
        mine = {n: full[n][slices(b)].to(device, copy=True) for n, b in trainer.owned[rank].items()}
        try:
            report = s.push(mine, version=v, timeout=WAIT)
        except WeightSyncError as e:
            conn.send(("error", str(e), list(e.failures)))
            continue
        st = s.statistics()
        per = {r: w.bytes_pushed for r, w in st.per_receiver.items()}
        conn.send((report.bytes, st.stream_bytes, per))
    s.close()


def _p2p_engine(rank, addresses, conn, device="cpu"):
    if device != "cpu":
        torch.cuda.set_device(device)
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    trainer, engine = fsdp_layout(specs, 2), tp_layout(specs, 2)
    params = {n: torch.zeros(s.shape, dtype=s.dtype, device=device)
              for n, s in engine.param_specs(rank).items()}  # fmt: skip
    armed, held, lock = threading.Event(), set(), threading.Lock()

    def around(load, items):  # once armed, each link's next load never ends (killed in it)
        if armed.is_set():
            with lock:
                held.add(threading.current_thread().name)
                if len(held) == len(addresses):  # every link mid-stream: the test is told
                    conn.send("loading")
            threading.Event().wait()
        load(items)

    r = ShardedReceiver(
        group="p2p", rank=rank, trainer=trainer, engine=engine, params=params,
        addresses=addresses, point_to_point=True, device=None if device == "cpu" else device,
        around_load=around,
    ).start(WAIT)  # fmt: skip
    conn.send("ready")
    while (msg := conn.recv()) != "stop":
        cmd, arg = msg if isinstance(msg, tuple) else ("wait", msg)
        if cmd == "hold":
            armed.set()
            conn.send("armed")  # before the trainer ranks are told to push
            continue
        if cmd == "connect":  # trainer rank 1's replacement
            r.connect(1, arg, timeout=WAIT)
            conn.send("connected")
            continue
        try:
            assert r.wait_for(arg, WAIT)
        except WeightSyncError as e:
            conn.send(("error", str(e), list(e.failures), r.version))
            continue
        want = expected_params(engine, rank, full_weights(specs, arg))
        conn.send((r.version, all(torch.equal(params[n].cpu(), want[n]) for n in want)))
    r.close()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "broadcast", "mixed"])
def test_point_to_point_links_carry_exactly_each_engine_ranks_bytes(transport):
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    plan = ShardPlan.build(fsdp_layout(specs, 2), tp_layout(specs, 2))
    trainers = [start(_p2p_trainer, r, transport) for r in range(2)]
    addresses = [recv(c) for _, c in trainers]
    assert all(sorted(a) == [0, 1] and a[0] != a[1] for a in addresses)  # a link per rank
    engines = [start(_p2p_engine, r, addresses) for r in range(2)]
    assert [recv(c) for _, c in engines] == ["ready", "ready"]
    try:
        for v in (1, 2):
            for _, c in [*trainers, *engines]:
                c.send(v)
            pushed = [recv(c) for _, c in trainers]
            assert [recv(c) for _, c in engines] == [(v, True), (v, True)]
            for s, (sent, stream, per) in enumerate(pushed):
                links = {r: plan.link_bytes(s, r) for r in range(2)}
                assert per == {r: v * b for r, b in links.items()}  # each link: its rank's bytes
                assert sent == stream == sum(links.values())
    finally:
        stop(*engines, *trainers)


def one_rank_to_tp2(group, specs, around_load=(None, None), **sender_kw):
    """One trainer rank and the two ranks of a TP=2 engine, in this process: the engine
    layout, the sender, each engine rank's tensors and its started receiver."""
    trainer, engine = fsdp_layout(specs, 1), tp_layout(specs, 2)
    sender = ShardedSender(group=group, rank=0, trainer=trainer, engine=engine, **sender_kw)
    p2p = sender_kw.get("point_to_point", False)
    params = [{n: torch.zeros(s.shape, dtype=s.dtype) for n, s in engine.param_specs(r).items()}
              for r in (0, 1)]  # fmt: skip
    receivers = []
    try:
        for r in (0, 1):
            receivers.append(ShardedReceiver(
                group=group, rank=r, trainer=trainer, engine=engine, params=params[r],
                addresses=[sender.addresses if p2p else sender.address], point_to_point=p2p,
                around_load=around_load[r],
            ).start(WAIT))  # fmt: skip
    except BaseException:
        close_all(sender, receivers)
        raise
    return engine, sender, params, receivers


def assert_hold(engine, receivers, params, full, version):
    """Every engine rank reached ``version`` and holds its parts of ``full`` exactly."""
    for r, receiver in enumerate(receivers):
        assert receiver.wait_for(version, WAIT)
        want = expected_params(engine, r, full)
        assert all(torch.equal(params[r][n], want[n]) for n in want)


def close_all(sender, receivers):
    for r in receivers:
        r.close()
    sender.close()


@pytest.mark.parametrize("one_thread", [False, True])
def test_one_engine_rank_failing_fails_only_its_link_of_a_point_to_point_push(
    one_thread, monkeypatch
):
    """A rank's links push side by side (a thread a link, as on the CPU, or one thread
    taking their steps in turn, as on NCCL): an engine rank whose load raises fails its
    link (named) and the other link's push goes on and commits; the next push works for
    both."""
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    fail_at = {0: 3}  # engine rank 0's load raises in the push of version 3 (its link first)
    sender_version = [0]

    def load_of(rank):
        def around(load, items):
            if fail_at.get(rank) == sender_version[0]:
                raise RuntimeError("the engine ran out of memory")
            load(items)

        return around

    engine, sender, params, receivers = one_rank_to_tp2(
        "one-fails", specs, (load_of(0), load_of(1)), transport="broadcast",
        bucket_bytes=16 << 10, point_to_point=True,
    )  # fmt: skip
    monkeypatch.setattr(sender, "_one_thread", lambda: one_thread)
    try:
        for v in (1, 2, 3, 4):
            sender_version[0] = v
            full = full_weights(specs, v)
            if v == 3:
                with pytest.raises(WeightSyncError) as e:
                    sender.push(full, version=v, timeout=WAIT)
                assert list(e.value.failures) == ["engine-rank-0<-trainer0"]
                assert "the engine ran out of memory" in str(e.value)
                links = sender.statistics().per_receiver  # the other link's push went on
                assert (links[1].pushes, links[1].failed_pushes) == (3, 0)
                # each end of a link holds two buffers of its bucket (the engine rank's own)
                made = receivers[1].statistics().links[0].buffer_bytes
                assert made == links[1].buffer_bytes == 2 * (16 << 10)
            else:
                sent = sender.push(full, version=v, timeout=WAIT).bytes
                assert sent == sum(sender.plan().link_bytes(0, r) for r in range(2))
            assert receivers[1].wait_for(v, WAIT)
            assert receivers[0].version == (2 if v == 3 else v)
            for r in range(2):
                want = expected_params(engine, r, full_weights(specs, receivers[r].version))
                assert all(torch.equal(params[r][n], want[n]) for n in want if r == 1 or v != 3)
    finally:
        close_all(sender, receivers)


def interrupt_the_third_push(group, transport, push, after_two=lambda sender: None, **kw):
    """One trainer rank to a TP=2 engine in this process, point to point over ``transport``
    (``kw``: the sender's other arguments, ``prepare`` a function of it): ``push(sender, specs,
    v)`` pushes versions 1 and 2 (``after_two(sender)`` checks then), a Ctrl-C lands while
    version 3's push runs (engine rank 0 holds its load), then version 4 reaches both engine
    ranks exactly."""
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    entered, gate, pushing = threading.Event(), threading.Event(), [0]

    def held(load, items):  # engine rank 0 holds version 3's load until the push was interrupted
        if pushing[0] == 3:
            entered.set()
            assert gate.wait(WAIT)
        load(items)

    prepare = kw.pop("prepare", lambda sender: None)
    engine, sender, params, receivers = one_rank_to_tp2(
        group, specs, (held, None), transport=transport, point_to_point=True, **kw
    )
    prepare(sender)
    armed = [False]

    def interrupt(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    def kill_when_held():
        assert entered.wait(WAIT)
        os.kill(os.getpid(), signal.SIGUSR1)

    before = signal.signal(signal.SIGUSR1, interrupt)
    try:
        for v in (1, 2):
            pushing[0] = v
            push(sender, specs, v)
        after_two(sender)
        pushing[0], armed[0] = 3, True
        killer = threading.Thread(target=kill_when_held)
        killer.start()
        with pytest.raises(KeyboardInterrupt):
            push(sender, specs, 3)
        armed[0] = False
        gate.set()
        killer.join(WAIT)
        pushing[0] = 4
        push(sender, specs, 4)
        for r in range(2):
            assert receivers[r].wait_for(4, WAIT)
            want = expected_params(engine, r, full_weights(specs, 4))
            assert all(torch.equal(params[r][n], want[n]) for n in want)
    finally:
        signal.signal(signal.SIGUSR1, before)
        gate.set()
        close_all(sender, receivers)


@pytest.mark.slow
@pytest.mark.parametrize("one_thread", [False, True])
def test_an_interrupt_during_a_point_to_point_push_aborts_its_links_and_the_next_push_works(
    one_thread, monkeypatch
):
    """Ctrl-C while a rank pushes its links: it goes up at once (a link still pushing ends on
    its own, within its timeout; taken in turn by one thread, it is aborted), each engine
    rank holds a whole version, and the next push works."""

    def push(sender, specs, v):
        sender.push(full_weights(specs, v), version=v, timeout=WAIT)

    interrupt_the_third_push(
        "interrupted", "broadcast", push,
        prepare=lambda sender: monkeypatch.setattr(sender, "_one_thread", lambda: one_thread),
    )  # fmt: skip


def test_an_interrupt_in_a_push_started_without_the_loop_aborts_it_and_the_next_works():
    """Over shm, pushes of the same tensors after one that every receiver committed start
    from the pushing thread alone and end on the receivers' commit datagrams; a Ctrl-C
    while one waits for them (engine rank 0 holds its load) aborts it, and the next push
    (the usual way) brings every rank to its version exactly."""
    mine = {}

    def push(sender, specs, v):  # the same tensors, new values in place
        for n, t in full_weights(specs, v).items():
            mine.setdefault(n, torch.empty_like(t)).copy_(t)
        sender.push(mine, version=v, timeout=WAIT)

    def after_two(sender):
        links = sender.statistics().per_receiver.values()
        assert [w.started_here for w in links] == [1, 1]  # version 2
        assert [w.commits_on_line for w in links] == [2, 2]

    interrupt_the_third_push("lean-interrupted", "shm", push, after_two)


def test_an_interrupt_between_two_steps_of_a_push_closes_it():
    """A Ctrl-C lands between two steps as often as in one: the push is closed (it aborts
    and lets its sender's lock go), not left suspended for its receivers to wait on."""
    seen = []

    def push():
        try:
            yield False
            yield True
        except GeneratorExit:
            seen.append("closed")
            raise
        return "report"

    class Interrupted:  # its second step is interrupted before the push resumes
        def __init__(self):
            self.steps, self.calls = push(), 0

        def __next__(self):
            self.calls += 1
            if self.calls == 2:
                raise KeyboardInterrupt
            return next(self.steps)

        def close(self):
            self.steps.close()

    interrupted = Interrupted()  # held: the push is closed by drain, not collected
    with pytest.raises(KeyboardInterrupt):
        drain(interrupted)
    assert seen == ["closed"] and interrupted.calls == 2
    assert drain(push()) == "report" and seen == ["closed"]


def test_connect_refuses_addresses_without_this_engine_rank_and_keeps_its_link():
    specs = llama_specs(layers=1, hidden=64, inter=128, vocab=96, kv=32)
    engine, sender, params, receivers = one_rank_to_tp2(
        "connect-bad", specs, transport="shm", point_to_point=True
    )
    try:
        with pytest.raises(ValueError) as e:
            receivers[1].connect(0, {0: sender.addresses[0]}, timeout=WAIT)
        assert str(e.value) == (
            "connect.address: expected trainer rank 0's addresses by engine rank, with this "
            "one's (1), got engine ranks [0] (give the replacement's ShardedSender.addresses)"
        )
        sender.push(full_weights(specs, 1), version=1, timeout=WAIT)  # its link is still there
        assert_hold(engine, receivers, params, full_weights(specs, 1), 1)
    finally:
        close_all(sender, receivers)


def _held_at_bucket(k, links, conn):
    """Make this process's pushes stop before bucket ``k`` once armed: each link's push
    waits there, and when all ``links`` do the test is told (and kills the process)."""
    from rlferry.weights.sender import _finishing, _pusher

    bucketed, armed, held, lock = _pusher.bucketed, threading.Event(), [0], threading.Lock()

    def held_bucketed(*args):
        for i, bucket in enumerate(bucketed(*args)):
            if i == k and armed.is_set():
                with lock:
                    held[0] += 1
                    if held[0] == links:
                        conn.send("holding")
                threading.Event().wait()  # killed here, mid-stream
            yield bucket

    _pusher.bucketed = _finishing.bucketed = held_bucketed  # a push's buckets, both ways
    return armed


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm-packed", "broadcast"])
def test_a_trainer_rank_killed_mid_stream_of_a_point_to_point_push_fails_by_name(transport):
    """Trainer rank 1 dies while it streams version 3 (each link's first bucket packed and
    sent, the second not): every engine rank fails version 3 naming trainer rank 1 and
    stays at version 2 (its loads are in place: the parts of version 3 that loaded hold
    new bytes), the rank's replacement joins, and version 4 is exact."""
    kill_a_trainer_rank_mid_stream(transport)


def two_by_two_at_version_2(trainer, engine, transport):
    """Two trainer ranks (processes running ``trainer``) and the two ranks of a TP=2 engine
    (``engine``), point to point, after two exact updates: trainers, addresses, engines."""
    trainers = [start(trainer, r, transport) for r in range(2)]
    engines = []
    try:
        addresses = [recv(c) for _, c in trainers]
        engines = [start(engine, r, addresses) for r in range(2)]
        assert [recv(c) for _, c in engines] == ["ready", "ready"]
        for v in (1, 2):
            for _, c in trainers:
                c.send(v)
            [recv(c) for _, c in trainers]
            assert at(engines, v) == [(v, True)] * 2
    except BaseException:
        stop(*engines, *trainers)
        raise
    return trainers, addresses, engines


def push_3_and_kill(trainers, victim, arm, held):
    """Arm ``victim`` (a process and its pipe) to stop mid-stream, let the trainer ranks push
    version 3, kill it once it says ``held``; the time of the kill."""
    victim[1].send(arm)
    if isinstance(arm, tuple):  # an engine rank: armed before a bucket of version 3 can come
        assert recv(victim[1]) == "armed"  # (a trainer rank reads "hold" before its push)
    for _, c in trainers:
        c.send(3)
    assert recv(victim[1]) == held
    os.kill(victim[0].pid, signal.SIGKILL)
    return time.monotonic()


def kill_a_trainer_rank_mid_stream(transport, trainer_device="cpu", engine_device="cpu"):
    """The test above, on these devices (the GPU test runs it over NCCL)."""
    trainer = functools.partial(_p2p_trainer, device=trainer_device)
    engine = functools.partial(_p2p_engine, device=engine_device)
    trainers, addresses, engines = two_by_two_at_version_2(trainer, engine, transport)
    try:
        killed = push_3_and_kill(trainers, trainers[1], "hold", "holding")
        for r, (_, c) in enumerate(engines):
            c.send(("wait", 3))
            kind, msg, failures, version = recv(c)
            print(f"engine rank {r} failed {time.monotonic() - killed:.3f} s after the kill")
            assert (kind, failures, version) == ("error", ["trainer rank 1"], 2)
            assert msg.startswith(
                f"receiver `engine-rank-{r}` (engine rank {r}) cannot reach version 3: trainer "
                f"rank 1: the sender at {addresses[1][r]} went away (it closed or died)"
            )
            assert msg.count("stays at version 2") == 1  # the link's own advice is not in it
            assert msg.endswith("it stays at version 2 (join a dead rank's replacement by connect)")
        replacement = start(trainer, 1, transport)
        address = recv(replacement[1])
        for _, c in engines:
            c.send(("connect", address))
            assert recv(c) == "connected"
        trainers[1] = replacement
        recv(trainers[0][1])  # rank 0's push of version 3 ended (committed or failed)
        for _, c in trainers:
            c.send(4)
        [recv(c) for _, c in trainers]
        assert at(engines, 4) == [(4, True)] * 2
    finally:
        stop(*engines, *trainers)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm-packed", "broadcast"])
def test_an_engine_rank_killed_mid_stream_fails_its_links_by_name_and_the_others_commit(
    transport,
):
    """Engine rank 0 dies while it loads a bucket of version 3 from each trainer rank: each
    trainer rank's push fails naming its link to engine rank 0 (and only it); engine rank 1
    commits version 3 whole; the rank's replacement joins and version 4 reaches both."""
    trainers, addresses, engines = two_by_two_at_version_2(_p2p_trainer, _p2p_engine, transport)
    try:
        killed = push_3_and_kill(trainers, engines[0], ("hold", None), "loading")
        for t, (_, c) in enumerate(trainers):
            kind, msg, failures = recv(c)
            print(
                f"trainer rank {t}: failed {time.monotonic() - killed:.3f} s after the kill: {msg}"
            )
            assert (kind, failures) == ("error", [f"engine-rank-0<-trainer{t}"])
            assert "disconnected (its process died or it closed its receiver)" in msg
        assert at(engines[1:], 3) == [(3, True)]  # the other engine rank: version 3, whole
        engines[0] = start(_p2p_engine, 0, addresses)  # its replacement
        assert recv(engines[0][1]) == "ready"
        for _, c in trainers:
            c.send(4)
        [recv(c) for _, c in trainers]
        assert at(engines, 4) == [(4, True)] * 2
    finally:
        stop(*engines, *trainers)


def _placements(store, conn):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    t = torch.zeros(6, 4)
    cols = dtensor_layout([("w", DTensor.from_local(t, mesh, [Shard(1)]))], ranks=3)
    rep = dtensor_layout([("w", DTensor.from_local(t, mesh, [Replicate()]))])
    try:
        dtensor_layout([("w", DTensor.from_local(t, mesh, [Partial()]))])
        error = None
    except ValueError as e:
        error = str(e)
    conn.send((cols.owned, rep.owned, error))
    dist.destroy_process_group()


@pytest.mark.slow
def test_dtensor_placements_give_boxes_and_a_partial_one_is_refused(tmp_path):
    proc, conn = start(_placements, str(tmp_path / "group"))
    cols, rep, error = recv(conn)
    proc.join(30)
    assert cols == ({"w": ((0, 6), (0, 4))}, {}, {})  # a 1-rank mesh: rank 0 holds it all
    assert rep == ({"w": ((0, 6), (0, 4))},)
    assert error == (
        "tensor `w`: expected Shard(d) or Replicate placements, got Partial(sum) (not a box "
        "of the full tensor: a Partial needs a reduction; give its full_tensor() or an "
        "explicit TrainerLayout)"
    )


def push_threads(senders, shards, version):
    """Every rank's push of ``version`` at once (each in a thread, as ranks push)."""
    pushes = [threading.Thread(target=s.push, args=(shards[r],),
                               kwargs={"version": version, "timeout": WAIT})
              for r, s in enumerate(senders)]  # fmt: skip
    for t in pushes:
        t.start()
    for t in pushes:
        t.join()


def test_a_receivers_tensors_moved_into_shared_memory_between_updates_still_get_every_byte():
    # A receiver's copies work on its tensors' addresses; share_memory_() moves a tensor's
    # storage (a zero-copy push of those same tensors onwards does it): the copies are built
    # again, never written to the old address.
    full = {f"layers.0.self_attn.{p}_proj.weight": torch.randn(64, 64) for p in "qkvo"}
    specs = specs_of(full.items())
    trainer, engine = fsdp_layout(specs, 2), EngineLayout.whole(specs)
    senders = [ShardedSender(group="moved", rank=r, trainer=trainer, engine=engine)
               for r in range(2)]  # fmt: skip
    params = {n: torch.zeros(s.shape) for n, s in engine.param_specs(0).items()}
    recv = ShardedReceiver(group="moved", rank=0, trainer=trainer, engine=engine, params=params,
                           addresses=[s.address for s in senders]).start()  # fmt: skip
    try:
        shards = [{n: full[n][slices(b)].clone() for n, b in trainer.owned[r].items()}
                  for r in range(2)]  # the same tensors every push: the same buckets  # fmt: skip
        for version in (1, 2, 3):
            values = {n: t + version for n, t in full.items()}
            for r in range(2):
                for n, b in trainer.owned[r].items():
                    shards[r][n].copy_(values[n][slices(b)])
            push_threads(senders, shards, version)
            assert recv.wait_for(version, timeout=WAIT)
            assert all(torch.equal(params[n], values[n]) for n in full)
            if version == 1:
                before = {n: t.data_ptr() for n, t in params.items()}
                for t in params.values():
                    t.share_memory_()
                assert all(t.data_ptr() != before[n] for n, t in params.items())
    finally:
        recv.close()
        for s in senders:
            s.close()


@pytest.mark.parametrize(("transport", "point_to_point"), [("shm", False), ("broadcast", True)])
def test_a_sender_given_other_tensors_or_moved_ones_sends_their_bytes(transport, point_to_point):
    # A rank's views of its tensors are kept while the same tensors come again (same
    # addresses, strides, shapes, dtypes: checked once a push), and its links then skip
    # their per-tensor checks (broadcast: the push starts streaming in the hop that picks
    # its receivers). Other tensors of the same layout, or a tensor whose storage was
    # swapped, must be cut again: their bytes arrive, never the old memory's.
    full = {f"layers.0.mlp.{p}_proj.weight": torch.randn(32, 16) for p in ("up", "gate")}
    specs = specs_of(full.items())
    trainer, engine = fsdp_layout(specs, 2), EngineLayout.whole(specs)
    senders = [ShardedSender(group="other", rank=r, trainer=trainer, engine=engine,
                             transport=transport, point_to_point=point_to_point)
               for r in range(2)]  # fmt: skip
    params = {n: torch.zeros(s.shape) for n, s in engine.param_specs(0).items()}
    addresses = [s.addresses if point_to_point else s.address for s in senders]
    recv = ShardedReceiver(group="other", rank=0, trainer=trainer, engine=engine, params=params,
                           addresses=addresses, point_to_point=point_to_point).start()  # fmt: skip

    def shards_of(values):
        return [{n: values[n][slices(b)].clone() for n, b in trainer.owned[r].items()}
                for r in range(2)]  # fmt: skip

    shards = shards_of(full)
    try:
        for version in range(1, 9):
            values = {n: t + version for n, t in full.items()}
            if version in (1, 2, 5, 7, 8):  # the same tensors, new values in place
                for r in range(2):
                    for n, b in trainer.owned[r].items():
                        shards[r][n].copy_(values[n][slices(b)])
            elif version in (3, 6):  # other tensors of the same layout
                shards = shards_of(values)
            else:  # the same tensor objects, their storages swapped
                for r, new in enumerate(shards_of(values)):
                    for n, t in shards[r].items():
                        t.data = new[n]
            # 7, 8: a state dict's entry that is not a tensor, nor in the layout, beside them
            extra = {"_extra_state": {"step": version}} if version >= 7 else {}
            push_threads(senders, [{**s, **extra} for s in shards], version)
            assert recv.wait_for(version, timeout=WAIT)
            assert all(torch.equal(params[n], values[n]) for n in full), version
        link = senders[0].statistics()
        groups = [w.groups_formed for w in link.per_receiver.values()] if point_to_point else []
        assert groups == ([1] if point_to_point else [])  # the group formed once, kept
        # over shm the receivers read the tensors in place: a push of the same tensors after
        # one its receivers all committed starts from the pushing thread alone (version 2;
        # other tensors are packed from version 3 on: only the first push's move them into
        # shared memory)
        here = [s.statistics().link.started_here for s in senders] if not point_to_point else []
        assert here == ([] if point_to_point else [1, 1])
    finally:
        recv.close()
        for s in senders:
            s.close()


def test_a_tensor_moved_under_a_later_bucket_is_found_as_its_bucket_goes_and_kept_there():
    # Over broadcast a push of the same tensors reads where they lie a bucket at a time,
    # as the buckets go: a tensor found elsewhere in a later bucket has its pieces cut
    # again before that bucket packs (its grouped copy built anew), and the next pushes
    # read it where it lies now.
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    engine, sender, params, receivers = one_rank_to_tp2(
        "later", specs, transport="broadcast", point_to_point=True, bucket_bytes=8192
    )
    full = {s.name: torch.randn(s.shape) for s in specs}
    shards = {n: t.clone() for n, t in full.items()}
    last = specs[-1].name
    try:
        for version in range(1, 7):
            values = {n: t + version for n, t in full.items()}
            if version == 4:  # the last tensor's storage swapped, the others in place
                shards[last].data = values[last].clone()
            for n, t in shards.items():
                t.copy_(values[n])
            report = sender.push(shards, version=version, timeout=WAIT)
            assert report.buckets > 4
            assert_hold(engine, receivers, params, values, version)
    finally:
        close_all(sender, receivers)


@pytest.mark.parametrize(("transport", "point_to_point"), [("shm", False), ("broadcast", True)])
def test_a_missing_or_misshapen_tensor_fails_the_push_by_name_and_the_next_one_works(
    transport, point_to_point
):
    # Pushed after the links stream at once (the views kept, their checks skipped), a bad
    # tensor fails the push with its name, shape and the fix, before anything moves; the
    # engine ranks keep their last whole version and the next push works.
    full = {f"layers.0.mlp.{p}_proj.weight": torch.randn(32, 16) for p in ("up", "gate")}
    specs = specs_of(full.items())
    engine, sender, params, receivers = one_rank_to_tp2(
        "bad", specs, transport=transport, point_to_point=point_to_point
    )
    up, gate = (f"layers.0.mlp.{p}_proj.weight" for p in ("up", "gate"))
    try:
        for v in (1, 2):
            sender.push({n: t + v for n, t in full.items()}, version=v, timeout=WAIT)
        with pytest.raises(WeightSyncError) as e:
            sender.push({up: full[up], gate: torch.zeros(16, 32)}, version=3, timeout=WAIT)
        assert str(e.value).startswith(
            f"push: tensor `{gate}` on trainer rank 0: expected its local shard of shape "
            "[32, 16], got [16, 32] (the trainer layout does not describe this rank's tensors)"
        )
        with pytest.raises(WeightSyncError) as e:
            sender.push({up: full[up]}, version=3, timeout=WAIT)
        assert str(e.value).startswith(
            f"push: tensor `{gate}`: expected it (trainer rank 0 owns [32, 16] of it and "
            "receivers need them), got no such name (push this rank's tensors under the "
            "trainer layout's names)"
        )
        for r in (0, 1):
            assert receivers[r].version == 2
            want = expected_params(engine, r, {n: t + 2 for n, t in full.items()})
            assert all(torch.equal(params[r][n], want[n]) for n in want)
        sender.push({n: t + 3 for n, t in full.items()}, version=3, timeout=WAIT)
        for r in (0, 1):
            assert receivers[r].wait_for(3, WAIT)
            want = expected_params(engine, r, {n: t + 3 for n, t in full.items()})
            assert all(torch.equal(params[r][n], want[n]) for n in want)
    finally:
        close_all(sender, receivers)


@pytest.mark.parametrize("point_to_point", [False, True])
def test_new_tensors_where_moved_ones_were_are_cut_again_never_sent_from_the_old_memory(
    point_to_point,
):
    # Over shm a push reads a rank's tensors in place: the first one moves their storages
    # into shared memory, and their old memory is freed. New tensors of the next push are
    # often allocated right there; the rank must compare them with where its views lie now
    # (the shared memory), not where the tensors were when cut, or it sends the old bytes
    # (it did: a receiver committed version 2 holding version 1's bytes).
    full = {f"layers.{i}.mlp.{p}_proj.weight": torch.randn(64, 32)
            for i in range(3) for p in ("up", "gate")}  # fmt: skip
    specs = specs_of(full.items())
    engine, sender, params, receivers = one_rank_to_tp2(
        "moved", specs, point_to_point=point_to_point
    )
    memory = bytearray(4 * sum(t.numel() for t in full.values()))

    def at_the_same_place(v):  # new tensors each push, over the same memory: where the
        # last push's tensors were before it moved them (as a freed allocation is reused)
        flat, out, at = torch.frombuffer(memory, dtype=torch.float32), {}, 0
        for n, t in full.items():
            out[n] = flat[at : at + t.numel()].view(t.shape).copy_(t + v)
            at += t.numel()
        return out

    try:
        for v in range(1, 9):
            values = at_the_same_place(v)
            sender.push(values, version=v, timeout=WAIT)
            for r in (0, 1):
                assert receivers[r].wait_for(v, WAIT)
                want = expected_params(engine, r, values)
                assert all(torch.equal(params[r][n], want[n]) for n in want), (v, r)
            del values
    finally:
        close_all(sender, receivers)


def test_a_ranks_links_share_its_buffer_budget_in_smaller_buckets():
    """Without ``bucket_bytes`` each link's buckets are cut so that the rank with the most
    links keeps its buffers within ``buffer_bytes``; every byte still arrives. A given
    ``bucket_bytes`` is used as it is; a budget below two 1 MiB buffers is refused."""
    specs = llama_specs(layers=2, hidden=256, inter=512, vocab=256, kv=128)  # 5.8 MB
    engine, sender, params, receivers = one_rank_to_tp2(
        "budget", specs, zero_copy=False, point_to_point=True, buffer_bytes=8 << 20
    )  # 2 links a rank at most: 2 MiB buckets
    try:
        full = full_weights(specs, 1)
        report = sender.push(full, version=1, timeout=WAIT)
        links = sender.statistics().per_receiver
        assert [links[r].bucket_bytes for r in (0, 1)] == [2 << 20, 2 << 20]
        assert sum(links[r].buffer_bytes for r in (0, 1)) == 8 << 20
        assert (
            report.buckets
            == sum(-(-sender.plan().link_bytes(0, r) // (2 << 20)) for r in (0, 1))
            > 2
        )  # more than a bucket a link
        assert_hold(engine, receivers, params, full, 1)
    finally:
        close_all(sender, receivers)
    engine, sender, params, receivers = one_rank_to_tp2(
        "budget-given", specs, zero_copy=False, point_to_point=True, buffer_bytes=8 << 20,
        bucket_bytes=3 << 20,
    )  # fmt: skip
    try:
        sender.push(full_weights(specs, 1), version=1, timeout=WAIT)
        assert [sender.statistics().per_receiver[r].bucket_bytes for r in (0, 1)] == [3 << 20] * 2
    finally:
        close_all(sender, receivers)
    # one shared stream: each engine rank hears from this one rank, so half the budget
    engine, sender, params, receivers = one_rank_to_tp2(
        "budget-shared", specs, zero_copy=False, buffer_bytes=8 << 20
    )
    try:
        full = full_weights(specs, 2)
        sender.push(full, version=2, timeout=WAIT)
        link = sender.statistics().link
        assert link is not None and (link.bucket_bytes, link.buffer_bytes) == (4 << 20, 8 << 20)
        assert_hold(engine, receivers, params, full, 2)
    finally:
        close_all(sender, receivers)
    trainer, engine = fsdp_layout(specs, 1), tp_layout(specs, 2)
    with pytest.raises(ValueError) as e:
        ShardedSender(group="g", rank=0, trainer=trainer, engine=engine, buffer_bytes=2 << 20)
    assert str(e.value) == (
        "ShardedSender.buffer_bytes: expected an int of at least 4194304 (two buffers of the "
        "smallest bucket), got 2097152 (bytes, as an int: 4 << 30 is 4 GiB)"
    )


def test_a_ranks_many_point_to_point_links_share_nccls_thread_blocks():
    """Point to point over broadcast, a link whose busier end has more than 8 links takes
    at most the NCCL blocks of ``link_ctas`` (NCCL's memory for a group grows with them:
    about 9 MiB a block); fewer links, and a shared stream, leave NCCL its own choice."""
    assert [link_ctas(n) for n in (1, 2, 8, 9, 11, 16, 256)] == [0, 0, 0, 3, 2, 2, 2]
    specs = llama_specs(layers=1, hidden=64, inter=128, vocab=96, kv=32)
    engine = tp_layout(specs, 2)
    for fsdp, p2p, want in ((1, True, 0), (16, True, 2), (16, False, 0)):
        with ShardedSender(
            group=f"ctas-{fsdp}-{p2p}", rank=0, trainer=fsdp_layout(specs, fsdp), engine=engine,
            transport="broadcast", point_to_point=p2p,
        ) as sender:  # fmt: skip
            # one trainer rank: 2 links (one an engine rank); sixteen: 16 an engine rank
            assert {r: link.parts.transport.max_ctas for r, link in sender._links.items()} == {
                r: want for r in sender._links
            }


@pytest.mark.parametrize(("transport", "point_to_point"), [("shm", False), ("broadcast", True)])
def test_a_layout_change_with_the_same_tensors_cuts_the_pieces_again(transport, point_to_point):
    # The views a rank keeps from push to push (the same tensors, updated in place) were
    # cut for one plan: after a layout change they are cut again, so every engine rank
    # holds exactly the new layout's parts.
    specs = llama_specs(layers=2, hidden=64, inter=128, vocab=96, kv=32)
    engine, sender, params, receivers = one_rank_to_tp2(
        "relaid", specs, transport=transport, point_to_point=point_to_point
    )
    mine = {n: t.clone() for n, t in full_weights(specs, 1).items()}
    try:
        for v in (1, 2):
            for n, t in full_weights(specs, v).items():
                mine[n].copy_(t)
            sender.push(mine, version=v, timeout=WAIT)
            assert_hold(engine, receivers, params, full_weights(specs, v), v)
        engine = engine_layout("replicas", specs)
        sender.set_layouts(engine=engine)
        for r, receiver in enumerate(receivers):
            params[r] = {n: torch.zeros(s.shape, dtype=s.dtype)
                         for n, s in engine.param_specs(r).items()}  # fmt: skip
            receiver.set_layouts(engine=engine, params=params[r], timeout=WAIT)
        for v in (3, 4):
            for n, t in full_weights(specs, v).items():
                mine[n].copy_(t)
            sender.push(mine, version=v, timeout=WAIT)
            assert_hold(engine, receivers, params, full_weights(specs, v), v)
    finally:
        close_all(sender, receivers)
