"""Sharded weights benchmark: N trainer ranks send what they own to M engine ranks.

Each trainer rank is a process holding its FSDP2 rows (``fsdp_layout``: dim 0 as
``torch.chunk``) of a state dict with Qwen3-8B's names and shapes, widths divided
by ``--scale`` (8: about 256 MB bf16), random values; each engine rank is a process
holding its slice of one TP=``--tp`` engine (default: ``--receivers``), fused
``qkv_proj`` / ``gate_up_proj`` included (``tp_layout``). An update: every trainer
rank pushes its pieces (``ShardedSender``), every engine rank waits for the whole
version (``ShardedReceiver``); its time runs from the parent's "push" until every
engine rank committed and every trainer rank's push returned (the later of the two).
At the end every engine compares its parameters with the full state dict, sliced as
it wants them (``identical``).

``--mode bound``, ``batched`` and ``control`` are the floors (``_weights_floor``): the links'
bytes in one communicator of every rank, bare or with rlferry's pack and load.

``--mode gather`` is the common way, in the same harness: the other trainer ranks first
send their rows to rank 0 (through the same transport, rank 0 the one receiver of
them; its own rows it copies), then rank 0 pushes the whole model through one
``WeightSender`` to engine ranks that cut their slices out of it as they load (as
vLLM's loader does); its seconds are gather plus push.

Prints a table and, with ``--json OUT``, one JSON line: ``identical``,
``model_bytes``, ``bytes_per_sender`` (per update), ``plans_computed`` (the most
any process computed), ``updates``, ``seconds`` (per update) and the setup.

CPU: ``--transport shm``. One GPU: ``--device cuda --transport cuda_ipc`` (every
process on that GPU; with ``--point-to-point --gpus K``, trainer and engine ranks on
GPUs of their own, each engine rank reading its trainer ranks' memory across). Several
GPUs: ``--device cuda --transport broadcast --point-to-point`` (a GPU per process,
trainer ranks first: each link a group of two, NCCL send and receive), against
``--mode gather`` (rank 0 then broadcasts to every engine rank: the rank-0 funnel).
With fewer GPUs than processes, ``--gpus K`` puts the trainer ranks on the first half
of K GPUs and the engine ranks on the rest (point to point only; the funnel's groups
would hold two ranks of one GPU).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from rlferry.weights import (
    EngineLayout,
    ParamLayout,
    Part,
    ShardedReceiver,
    ShardedSender,
    ShardPlan,
    TensorSpec,
    TrainerLayout,
    WeightReceiver,
    WeightSender,
    fsdp_layout,
    tp_layout,
)
from rlferry.weights._boxes import extents, slices

import _trace
import _weights_engine as eng
from _common import receive, start_worker, table

WAIT = 600.0  # a process's start, an engine rank's wait for a version
# A push's own bound: one that hangs fails in 2 minutes naming the engine ranks it waited
# for (a first update, groups forming and kernels compiling, takes 2-7 s on four GPUs)
PUSH_WAIT = 120.0


def specs_for(args: argparse.Namespace) -> list[TensorSpec]:
    return [TensorSpec(n, s, torch.bfloat16) for n, s in eng.model_shapes(args.model, args.scale)]


def full_tensor(spec: TensorSpec, device: str) -> torch.Tensor:
    """The same values in every process: seeded by the tensor's name (made on ``device``)."""
    g = torch.Generator(device=device).manual_seed(sum(map(ord, spec.name)) * 7919 + len(spec.name))
    return torch.randn(spec.shape, generator=g, device=device).to(spec.dtype)


def gather_layout(trainer: TrainerLayout) -> EngineLayout:
    """Rank 0 as the one receiver of every other rank's rows (its own it copies itself)."""
    params = []
    for s in trainer.specs:
        parts = tuple(
            Part(s.name, boxes[s.name], boxes[s.name])
            for r, boxes in enumerate(trainer.owned)
            if r and s.name in boxes
        )
        if parts:
            params.append(ParamLayout(s.name, s.shape, s.dtype, parts))
    return EngineLayout(trainer.specs, (tuple(params),))


def gpu_of(args: argparse.Namespace, role: str, rank: int) -> int:
    """With broadcast (NCCL): a GPU per process, the trainer ranks first, then the engine
    ranks; with ``--gpus K`` the trainer ranks share the first K // 2 GPUs (round robin)
    and the engine ranks the others, so that every link of two crosses GPUs."""
    if not args.gpus:
        return rank if role == "trainer" else args.senders + rank
    half = args.gpus // 2
    return rank % half if role == "trainer" else half + rank % (args.gpus - half)


def device_of(args: argparse.Namespace, role: str, rank: int) -> str:
    """``cpu``; with cuda_ipc every process on GPU 0 (with ``--gpus``: see :func:`gpu_of`,
    each engine rank reading its trainer ranks' GPUs across); with broadcast see
    :func:`gpu_of`.
    Called first in every process of the run: it also sets ``--switch-interval`` and
    starts ``--trace``."""
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if getattr(args, "trace", None):
        _trace.install(args.trace)
    if args.device == "cpu":
        return "cpu"
    if args.transport != "broadcast" and not args.gpus:
        return "cuda:0"
    gpu = gpu_of(args, role, rank)
    if gpu >= torch.cuda.device_count():
        raise SystemExit(
            f"--transport {args.transport}: expected GPU {gpu} for {role} rank {rank} "
            f"({args.senders} trainer and {args.receivers} engine ranks, --gpus "
            f"{args.gpus or 'one per process'}), got {torch.cuda.device_count()} GPUs"
        )
    return f"cuda:{gpu}"


def local_shards(
    args: argparse.Namespace, trainer: TrainerLayout, rank: int, dev: str
) -> dict[str, torch.Tensor]:
    """Trainer rank ``rank``'s rows of every tensor, on ``dev``."""
    specs = {s.name: s for s in trainer.specs}
    owned = trainer.owned[rank].items()
    return {n: full_tensor(specs[n], dev)[slices(b)].clone() for n, b in owned}


def expected_params(
    args: argparse.Namespace, engine: EngineLayout, trainer: TrainerLayout, rank: int, dev: str
) -> dict[str, torch.Tensor]:
    """What engine rank ``rank``'s parameters must hold: its parts of the full tensors."""
    specs = {s.name: s for s in trainer.specs}
    out = {}
    for p in engine.receivers[rank]:
        want = torch.zeros(p.shape, dtype=p.dtype, device=dev)
        for q in p.parts:
            src = full_tensor(specs[q.source], dev)[slices(q.box)]
            want[slices(q.at)] = src.reshape(extents(q.at))
        out[p.name] = want
    return out


def layouts(args: argparse.Namespace) -> tuple[TrainerLayout, EngineLayout]:
    specs = specs_for(args)
    tp = args.tp or args.receivers
    return fsdp_layout(specs, args.senders), tp_layout(specs, tp, replicas=args.receivers // tp)


def _trainer(rank: int, args: argparse.Namespace, conn: Connection) -> None:
    """A trainer rank: its rows of every tensor; pushes its pieces (or, in gather mode,
    sends them to rank 0, which pushes the whole model)."""
    trainer, engine = layouts(args)
    specs = {s.name: s for s in trainer.specs}
    dev = device_of(args, "trainer", rank)
    mine = local_shards(args, trainer, rank, dev)
    kw = {"transport": args.transport, "device": dev, "bucket_bytes": _bucket(args)}
    before = outside_before(dev)
    if args.mode == "sharded":
        s = ShardedSender(
            group="bench", rank=rank, trainer=trainer, engine=engine,
            point_to_point=args.point_to_point, **kw,
        )  # fmt: skip
        conn.send(("address", s.addresses))
        with _Profile(args, "trainer", rank) as prof:
            while (msg := conn.recv()) != "stop":
                got = time.time()
                prof.update(msg)
                s.push(mine, version=msg, timeout=PUSH_WAIT)
                st = s.statistics()
                conn.send(("pushed", st.stream_bytes, st.plans_computed, (got, time.time())))
        report_outside(dev, *before, f"trainer rank {rank} ({len(s.addresses)} links)")
        s.close()
        return
    # gather mode: every other rank sends its rows to rank 0, which pushes the whole model
    gather = gather_layout(trainer)
    g = None
    if rank:
        g = ShardedSender(group="gather", rank=rank, trainer=trainer, engine=gather, **kw)
        conn.send(("address", g.address))
    else:
        conn.send(("address", ""))
        full = {n: torch.empty(s.shape, dtype=s.dtype, device=dev) for n, s in specs.items()}
        if args.senders == 1:  # nothing to gather: rank 0 pushes its own tensors
            full = mine
        addresses = conn.recv()
        gathered = None
        if args.senders > 1:
            gathered = ShardedReceiver(
                group="gather", rank=0, trainer=trainer, engine=gather, params=full,
                addresses=addresses, device=dev,
            )  # fmt: skip
            threading.Thread(target=gathered.start, args=(WAIT,), daemon=True).start()
        push = WeightSender(group="bench", receivers=args.receivers, **kw)
        conn.send(("address", push.address))
    while (msg := conn.recv()) != "stop":
        if g is not None:
            g.push(mine, version=msg, timeout=PUSH_WAIT)
            conn.send(("pushed", g.statistics().stream_bytes, g.statistics().plans_computed))
            continue
        if args.senders > 1:
            for n, b in trainer.owned[0].items():
                full[n][slices(b)].copy_(mine[n])
        if gathered is not None:
            assert gathered.wait_for(msg, WAIT)
        push.push(full.items(), version=msg, timeout=PUSH_WAIT)
        sent = sum(t.numel() * t.element_size() for t in full.values())
        conn.send(("pushed", sent, gathered.statistics().plans_computed if gathered else 0))
    if g is not None:
        g.close()
    else:
        push.close()
        if gathered is not None:
            gathered.close()


def _engine(rank: int, args: argparse.Namespace, addresses: Any, conn: Connection) -> None:
    trainer, engine = layouts(args)
    dev = device_of(args, "engine", rank)
    params = {
        n: torch.zeros(s.shape, dtype=s.dtype, device=dev)
        for n, s in engine.param_specs(rank).items()
    }
    committed: dict[int, float] = {}  # version -> when it committed (wall clock)
    before = outside_before(dev)
    if args.mode == "sharded":
        r: Any = ShardedReceiver(
            group="bench", rank=rank, trainer=trainer, engine=engine, params=params,
            addresses=addresses, device=dev, point_to_point=args.point_to_point,
            on_commit=lambda v: committed.__setitem__(v, time.time()),
        ).start(WAIT)  # fmt: skip
    else:  # today's receiver of the whole model, cutting its slices out as vLLM's loader does
        # each source tensor lies in one parameter of a rank (fused ones in several parts)
        parts = {q.source: (p.name, q) for p in engine.receivers[rank] for q in p.parts}

        def load(items: list[tuple[str, torch.Tensor]]) -> None:
            for n, t in items:
                for name, q in [parts[n]] if n in parts else []:
                    params[name][slices(q.at)].copy_(t[slices(q.box)])

        r = WeightReceiver(group="bench", address=addresses, load=load, device=dev).start(WAIT)
    conn.send(("ready", None))
    with _Profile(args, "engine", rank) as prof:
        while (msg := conn.recv()) != "stop":
            got = time.time()
            prof.update(msg)
            assert r.wait_for(msg, WAIT)
            if dev.startswith("cuda"):
                torch.cuda.synchronize(dev)
            conn.send(("at", msg, (got, committed.get(msg, 0.0), time.time())))
    want = expected_params(args, engine, trainer, rank, dev)
    same = all(torch.equal(want[n], params[n]) for n in want)
    plans = r.statistics().plans_computed if args.mode == "sharded" else 0
    report_outside(
        dev,
        *before,
        f"engine rank {rank} ({len(r.statistics().links)} links)"
        if args.mode == "sharded"
        else f"engine rank {rank}",
    )
    r.close()  # before the trainers close their links (their groups' stores go with them)
    conn.send(("identical", same, plans))


def outside_before(dev: Any) -> tuple[int, int]:
    """The device's free memory and torch's reserved memory, before a rank's links exist."""
    dev = torch.device(dev)
    if dev.type != "cuda":
        return 0, 0
    return torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)


def report_outside(dev: Any, free: int, reserved: int, who: str) -> None:
    """Print what the device lost since :func:`outside_before` outside torch's allocator
    (NCCL's communicators and their connections; a GPU a process, else others' count)."""
    dev = torch.device(dev)
    if dev.type == "cuda":
        taken = (free - torch.cuda.mem_get_info(dev)[0]) - (
            torch.cuda.memory_reserved(dev) - reserved
        )
        print(
            f"{who}: {taken / 2**20:.0f} MiB outside torch's allocator", file=sys.stderr, flush=True
        )


def _bucket(args: argparse.Namespace) -> int | None:
    return args.bucket_mb << 20 if args.bucket_mb else None


class _Profile:
    """With ``--profile DIR``: this process's CPU and GPU activity over the last two
    updates, as a Chrome trace ``DIR/ROLE-RANK.json`` (GPU kernels of every thread)."""

    def __init__(self, args: argparse.Namespace, role: str, rank: int) -> None:
        self.dir, self.first = args.profile, max(1, args.updates - 1)
        self.path = f"{args.profile}/{role}-{rank}.json" if args.profile else ""
        self.prof: Any = None

    def update(self, version: int) -> None:
        if self.dir and version == self.first:
            from torch._C._profiler import _ExperimentalConfig
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(ProfilerActivity.CUDA)
            try:  # the links' threads too (torch 2.7 and later)
                config = _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
            except TypeError:
                config = _ExperimentalConfig()
            self.prof = profile(activities=acts, experimental_config=config)
            self.prof.__enter__()

    def __enter__(self) -> _Profile:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            os.makedirs(self.dir, exist_ok=True)
            self.prof.export_chrome_trace(self.path)


def _recv(conn: Connection, what: str) -> Any:
    _kind, value, *rest = receive(conn, what, WAIT)
    return (value, *rest) if rest else value


def run(args: argparse.Namespace) -> dict[str, Any]:
    trainer, engine = layouts(args)
    if args.mode in ("bound", "batched", "control"):
        from _weights_floor import run_floor

        seconds, sent, same = run_floor(args)
        return _result(args, trainer, engine, same, sent, 0, seconds)
    ctx = mp.get_context("spawn")
    t0 = time.monotonic()
    trainers = [start_worker(ctx, _trainer, r, args) for r in range(args.senders)]
    addresses = [_recv(c, "trainer address") for _, c in trainers]
    if args.mode == "gather":
        trainers[0][1].send(addresses)
        push_address = _recv(trainers[0][1], "rank 0's push address")
    targets = addresses if args.mode == "sharded" else push_address
    engines = [start_worker(ctx, _engine, r, args, targets) for r in range(args.receivers)]
    for _, c in engines:
        _recv(c, "engine start")
    print(f"[{time.monotonic() - t0:6.1f} s] started", file=sys.stderr, flush=True)
    seconds, sent, plans = [], [0] * args.senders, 0
    phases: list[dict[str, float]] = []
    for v in range(1, args.updates + 1):
        t, wall = time.perf_counter(), time.time()
        for _, c in trainers + engines:
            c.send(v)
        ats = [_recv(c, f"commit of version {v}") for _, c in engines]
        reports = [_recv(c, "push report") for _, c in trainers]
        seconds.append(time.perf_counter() - t)  # both ends done: engines and pushes
        assert all(a[0] == v for a in ats), ats
        pushes = []
        for i, (n, p, *stamps) in enumerate(reports):
            sent[i], plans = n, max(plans, p)
            pushes += stamps
        phases.append(_phases(wall, pushes, [a[1] for a in ats]))
    for _, c in engines:
        c.send("stop")
    same = True
    for _, c in engines:
        ok, p = _recv(c, "check")
        same, plans = same and ok, max(plans, p)
    for _, c in trainers:
        c.send("stop")
    for proc, _ in engines + trainers:
        proc.join(60)
    out = _result(args, trainer, engine, same, sent, plans, seconds)
    out["phases_ms"] = {k: [round(p[k], 3) for p in phases] for k in phases[0]} if phases else {}
    return out


def _phases(sent: float, pushes: list[Any], commits: list[Any]) -> dict[str, float]:
    """Where an update's time went (ms from the parent's send, wall clock): the trainer
    ranks' receipt of it and the end of their pushes (the latest), the engine ranks'
    commits (the latest) and their replies after a device synchronize."""
    ms = lambda t: (t - sent) * 1e3  # noqa: E731
    if not pushes:  # gather mode: its trainers report no times
        return {}
    return {
        "trainer start": max(ms(a) for a, _ in pushes),
        "push end": max(ms(b) for _, b in pushes),
        "engine commit": max(ms(c) for _, c, _ in commits),
        "engine reply": max(ms(d) for _, _, d in commits),
    }


def _result(
    args: argparse.Namespace, trainer: TrainerLayout, engine: EngineLayout, same: bool,
    sent: list[int], plans: int, seconds: list[float],
) -> dict[str, Any]:  # fmt: skip
    plan = ShardPlan.build(trainer, engine)
    out = [sum(plan.link_bytes(s, r) for r in plan.receivers_of(s)) for s in range(args.senders)]
    into = [sum(plan.link_bytes(s, r) for s in plan.senders_of(r)) for r in range(args.receivers)]
    if args.gpus:  # ranks that share a GPU share its links
        by_gpu: dict[tuple[str, int], int] = {}
        for role, per_rank in (("trainer", out), ("engine", into)):
            for k, b in enumerate(per_rank):
                key = (role, gpu_of(args, role, k))
                by_gpu[key] = by_gpu.get(key, 0) + b
        out, into = list(by_gpu.values()), []
    return {
        "identical": same,
        "model_bytes": sum(s.nbytes for s in trainer.specs),
        "bytes_per_sender": sent,
        "plans_computed": plans,
        "updates": args.updates,
        "seconds": [round(s, 6) for s in seconds],
        "model": args.model,
        "scale": args.scale,
        "senders": args.senders,
        "receivers": args.receivers,
        "tp": args.tp or args.receivers,
        "mode": args.mode,
        "transport": args.transport,
        "device": args.device,
        "point_to_point": args.point_to_point,
        "gpus": args.gpus or None,
        "bucket_bytes": _bucket(args),
        "busiest_gpu_bytes": max(out + into),  # point to point: a GPU's bytes out or in
        "needed_bytes_per_receiver": [engine.needed_bytes(r) for r in range(args.receivers)],
        "machine": f"{platform.node()} {os.cpu_count()} cpus",
        "switch_interval": args.switch_interval or sys.getswitchinterval(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python benchmarks/weights_sharded.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--senders", type=int, default=2, help="trainer ranks (FSDP2 rows)")
    p.add_argument("--receivers", type=int, default=2, help="engine ranks")
    p.add_argument("--tp", type=int, default=0, help="engine TP (default: --receivers)")
    p.add_argument("--model", default="qwen3-8b", help="qwen3-8b or qwen3-30b-a3b")
    p.add_argument("--scale", type=int, default=8, help="divide every width (8: ~256 MB)")
    p.add_argument("--updates", type=int, default=5)
    p.add_argument(
        "--mode", choices=["sharded", "gather", "bound", "batched", "control"], default="sharded",
        help="bound: NCCL's own send/recv of each point-to-point link's bytes (GPUs); "
        "batched: the same with rlferry's pack and load around it, no control plane",
    )  # fmt: skip
    p.add_argument(
        "--transport",
        default="shm",
        help="shm (CPU), cuda_ipc (one GPU; with --gpus, GPUs of one host) or broadcast "
        "(NCCL, a GPU per process)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--point-to-point",
        action="store_true",
        help="sharded: a link per (trainer rank, engine rank), only its bytes",
    )
    p.add_argument(
        "--gpus", type=int, default=0,
        help="share K GPUs (trainer ranks on the first half, engine ranks on the rest; needs "
        "--point-to-point: an NCCL group takes one rank per GPU); with cuda_ipc each engine "
        "rank reads its trainer ranks' GPUs across (peer access)",
    )  # fmt: skip
    p.add_argument(
        "--bucket-mb", type=int, default=0,
        help="every sender's bucket size in MiB (default: the library's, from free memory)",
    )  # fmt: skip
    p.add_argument(
        "--profile", metavar="DIR",
        help="write each process's Chrome trace of the last two updates (CPU and GPU) to DIR",
    )  # fmt: skip
    p.add_argument(
        "--switch-interval", type=float, default=0.0, metavar="S",
        help="sys.setswitchinterval(S) in every trainer and engine process (Python's default: "
        "0.005): how long a thread that wants the GIL waits for one that does not let go",
    )  # fmt: skip
    p.add_argument(
        "--trace", metavar="DIR",
        help="stamp each step of a push in every process into DIR (benchmarks/_trace.py) and "
        "print the timeline of the update before the last",
    )  # fmt: skip
    p.add_argument("--json", help="append the JSON line to this file")
    args = p.parse_args(argv)
    if args.gpus and (args.gpus < 2 or args.mode != "sharded" or not args.point_to_point):
        p.error(
            f"--gpus: expected 2 or more with --mode sharded --point-to-point (links of two "
            f"processes on two GPUs), got --gpus {args.gpus} --mode {args.mode}"
            + ("" if args.point_to_point else " without --point-to-point")
        )
    if args.mode in ("bound", "batched", "control") and args.transport != "broadcast":
        p.error(
            f"--mode {args.mode}: expected --transport broadcast (NCCL on GPUs, a GPU per "
            f"process; gloo on the CPU), got --transport {args.transport}"
        )
    out = run(args)
    rest = sorted(out["seconds"][1:]) or out["seconds"]
    rows = [[
        str(out["senders"]), str(out["receivers"]), out["mode"], f"{out['model_bytes'] / 1e6:.1f}",
        " / ".join(f"{b / 1e6:.1f}" for b in out["bytes_per_sender"]),
        f"{out['seconds'][0] * 1e3:.1f}", f"{statistics.median(rest) * 1e3:.1f}",
        f"{rest[min(len(rest) - 1, int(0.9 * len(rest)))] * 1e3:.1f}",
        f"{rest[-1] * 1e3:.1f}", str(out["plans_computed"]), str(out["identical"]),
    ]]  # fmt: skip
    header = ["senders", "receivers", "mode", "model MB", "MB per sender", "first ms",
              "p50 ms (later)", "p90 ms", "max ms", "plans", "identical"]  # fmt: skip
    print(table(rows, header))
    phases = out.get("phases_ms") or {}
    if phases and len(out["seconds"]) > 1:
        line = ", ".join(f"{k} {statistics.median(v[1:]):.2f}" for k, v in phases.items() if v)
        print(f"phases, ms from the parent's send (p50 of later updates): {line}")
    if args.trace:
        print(_trace.timeline(args.trace))
    line = json.dumps(out)
    print(line)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
