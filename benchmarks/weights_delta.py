"""Delta pushes against full pushes of the same updates, after real AdamW steps.

The trainer holds fp32 master weights with Qwen3-8B's names and shapes (``--scale N``
divides every width, as the other weights benchmarks do), initialized as Hugging Face
does (normal, std 0.02; norms 1), and a bf16 copy it serves, refreshed from the masters
after each optimizer step (a mixed-precision trainer's model weights). Between updates,
one ``torch.optim.AdamW`` step with a random gradient at each ``--lr``. The engine is
another process holding bf16 parameters, joined by three receivers loading into them
with ``ParamLoader`` (deltas in place), one of each of three senders: a plain one (full
pushes: the baseline), one with ``delta_budget`` and ``delta_policy="always"`` (a delta
every update after the first: what a delta push costs) and one with the default measured
policy (what a user gets: it times both kinds and pushes the faster; ``measured kinds``:
d for a delta, f for full). Each update is pushed by the three in turn; after each
delta push the engine's parameters are checked bit for bit (SHA-256) against the
trainer's bf16 copy (``identical``). ``changed``: the fraction of bf16 elements that
changed, as the delta pushes found it.

``--transport gloo`` (broadcast between two processes on the CPU: the link-bound case
here), ``shm``, ``cuda_ipc`` (engine on the same GPU), ``broadcast`` (NCCL, engine on
a second GPU). ``--lora``: the rows of ``_lora_bench.lora_rows`` too, when that module
exists. ``--json PATH``: the rows (``transport``, ``lr``, ``kind``, ``identical``,
``changed_fraction``, ``full_bytes``, ``sent_bytes``, ``full_ms_p50``, ``sent_ms_p50``
and the rest of the table). Also printed: XOR of one bf16 tensor before and after an
AdamW step at the lowest lr, compressed with zlib and lzma (the stdlib's), against the
sparse encoding and the link.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import lzma
import math
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
import zlib
from multiprocessing.connection import Connection
from typing import Any

import torch

from rlferry.weights import ParamLoader, WeightReceiver, WeightSender, fingerprint
from rlferry.weights.delta._record import layout

import _weights_engine as eng
from _common import receive, start_worker, table

BF16 = torch.bfloat16


def _progress(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


# -- the trainer ---------------------------------------------------------------------------


class Trainer:
    """fp32 masters, their bf16 copy, and AdamW with a fixed random gradient per tensor."""

    def __init__(self, shapes: eng.Shapes, device: str, lr: float) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.masters = []
        for name, shape in shapes:
            p = torch.empty(shape, device=device)
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
            p = torch.nn.Parameter(p)
            p.grad = torch.empty_like(p).normal_(generator=g)
            self.masters.append((name, p))
        self.opt = torch.optim.AdamW([p for _, p in self.masters], lr=lr, foreach=False)
        self.serving = {n: p.detach().to(BF16) for n, p in self.masters}

    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        for n, p in self.masters:
            self.serving[n].copy_(p.detach())
        if self.masters[0][1].device.type == "cuda":
            torch.cuda.synchronize()


# -- the engine process --------------------------------------------------------------------


GROUPS = ("full", "delta", "measured")


def engine_main(shapes: eng.Shapes, device: str, conn: Connection) -> None:
    """Preallocated bf16 parameters; ``join`` starts a receiver loading into them for each
    sender of :data:`GROUPS`; ``fingerprint`` digests them."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    params = {n: torch.zeros(s, dtype=BF16, device=device) for n, s in shapes}
    receivers: list[WeightReceiver] = []
    dev = device if device.startswith("cuda") else None
    conn.send(("ok", "ready"))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            for r in receivers:
                r.close()
            return
        if cmd == "join":
            for group, address in zip(GROUPS, args, strict=True):
                r = WeightReceiver(
                    group=group,
                    address=address,
                    name=f"engine-{group}",
                    load=ParamLoader(params),
                    device=dev,
                    deltas="in_place",
                )
                receivers.append(r.start())
            conn.send(("ok", "joined"))
        elif cmd == "fingerprint":
            conn.send(("ok", fingerprint(params.items())))


class Engine:
    def __init__(self, shapes: eng.Shapes, device: str) -> None:
        self.proc, self.conn = start_worker(mp.get_context("spawn"), engine_main, shapes, device)
        self.wait("start")

    def wait(self, what: str) -> Any:
        status, value = receive(self.conn, f"engine's {what}", 1200)
        if status != "ok":
            raise RuntimeError(f"engine: {value}")
        return value

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.wait(cmd[0])

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(60)


# -- the run -------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    shapes = eng.model_shapes(args.model, args.scale)
    transport = "broadcast" if args.transport == "gloo" else args.transport
    cuda = args.transport in ("cuda_ipc", "broadcast")
    device = "cuda:0" if cuda else "cpu"
    engine_device = "cuda:1" if args.transport == "broadcast" else device
    if cuda:
        torch.cuda.set_device(device)
    lrs = [float(x) for x in args.lr.split(",")]
    _progress(f"trainer: {args.model} / {args.scale} on {device}")
    trainer = Trainer(shapes, device, lrs[0])
    full_bytes = sum(t.numel() * t.element_size() for t in trainer.serving.values())
    _progress("engine")
    engine = Engine(shapes, engine_device)
    senders = {
        "full": WeightSender(group="full", transport=transport),
        "delta": WeightSender(group="delta", transport=transport, delta_budget=full_bytes,
                              delta_base=args.delta_base, delta_policy="always"),
        "measured": WeightSender(group="measured", transport=transport,
                                 delta_budget=full_bytes, delta_base=args.delta_base),
    }  # fmt: skip
    rows = []
    try:
        engine.call("join", *(senders[g].address for g in GROUPS))
        version = 0
        for lr in lrs:
            _progress(f"lr {lr:g}")
            rows.append(_updates(args, lr, trainer, engine, senders, version))
            version += args.warmup + args.repeat
    finally:
        engine.stop()
        for sender in senders.values():
            sender.close()
    if args.lora:
        if importlib.util.find_spec("_lora_bench") is None:
            _progress("--lora: benchmarks/_lora_bench.py is not here; no LoRA rows")
        else:
            import _lora_bench  # type: ignore[import-not-found]

            rows += _lora_bench.lora_rows(args)
    return rows


def _updates(
    args: argparse.Namespace, lr: float, trainer: Trainer, engine: Engine,
    senders: dict[str, WeightSender], version: int,
) -> dict[str, Any]:  # fmt: skip
    """The row of ``lr``: each update pushed by every sender in turn, each delta checked."""
    ms: dict[str, list[float]] = {g: [] for g in GROUPS}
    sent, changed, kinds, identical = [], [], [], True
    for k in range(args.warmup + args.repeat):
        trainer.step(lr)
        version += 1
        for g in GROUPS:
            t0 = time.perf_counter()
            report = senders[g].push(trainer.serving.items(), version=version, timeout=600)
            seconds = time.perf_counter() - t0
            if report.kind == "delta":
                engine.conn.send(("fingerprint",))
                mine = fingerprint(trainer.serving.items())
                identical = identical and mine == engine.wait("fingerprint")
            if k < args.warmup:
                continue
            ms[g].append(seconds * 1e3)
            if g == "delta":
                sent.append(report.sent_bytes)
                if report.changed is not None:
                    changed.append(report.changed)
            if g == "measured":
                kinds.append(report.kind[0])
    f_ms, d_ms, m_ms = ms["full"], ms["delta"], ms["measured"]
    return {
        "transport": args.transport, "lr": lr, "kind": "delta", "identical": identical,
        "changed_fraction": statistics.median(changed) if changed else None,
        "full_bytes": report.full_bytes, "sent_bytes": int(statistics.median(sent)),
        "full_ms_p50": _pct(f_ms, 0.5), "sent_ms_p50": _pct(d_ms, 0.5),
        "full_ms_p90": _pct(f_ms, 0.9), "sent_ms_p90": _pct(d_ms, 0.9),
        "full_ms_max": max(f_ms), "sent_ms_max": max(d_ms),
        "measured_ms_p50": _pct(m_ms, 0.5), "measured_ms_p90": _pct(m_ms, 0.9),
        "measured_ms_max": max(m_ms), "measured_kinds": "".join(kinds),
        "scale": args.scale, "model": args.model,
    }  # fmt: skip


# -- XOR and compression -------------------------------------------------------------------


def xor_compression(args: argparse.Namespace, link_gbps: float) -> str:
    """XOR of one bf16 tensor before and after an AdamW step at the lowest lr, compressed."""
    shapes = eng.model_shapes(args.model, args.scale)
    name, shape = next((n, s) for n, s in shapes if "mlp.gate_proj" in n)
    lr = min(float(x) for x in args.lr.split(","))
    trainer = Trainer([(name, shape)], "cpu", lr)
    before = trainer.serving[name].clone()
    trainer.step(lr)
    after = trainer.serving[name]
    x = (before.view(torch.int16) ^ after.view(torch.int16)).numpy().tobytes()
    dense = len(x)
    n = int((before.view(torch.int16) != after.view(torch.int16)).sum())
    sparse = layout(before.numel(), n, 2)[3]
    out = [["sparse (counts, offsets, values)", f"{sparse / dense:.2%}", "-", "-"]]
    for label, fn in (
        ("zlib level 1", lambda b: zlib.compress(b, 1)),
        ("zlib level 6", lambda b: zlib.compress(b, 6)),
        ("lzma preset 0", lambda b: lzma.compress(b, preset=0)),
    ):
        t0 = time.perf_counter()
        z = fn(x)
        s = time.perf_counter() - t0
        out.append([f"XOR + {label}", f"{len(z) / dense:.2%}", f"{dense / s / 1e9:.3f}",
                    f"{dense / s / 1e9 / link_gbps:.2f}"])  # fmt: skip
    head = (
        f"`{name}` {list(shape)} bf16 ({dense / 1e6:.1f} MB), one AdamW step at lr {lr:g}: "
        f"{n / before.numel():.2%} of its elements changed; the link moved {link_gbps:.2f} GB/s"
    )
    rows = table(out, ("encoding", "bytes / dense", "encode GB/s", "x the link's speed"))
    return head + "\n\n" + rows


# -- the table -----------------------------------------------------------------------------


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    out = []
    for r in rows:
        if r["kind"] != "delta":
            continue
        c = r["changed_fraction"]
        goal = 1.5 * c * r["full_bytes"] + 0.01 * r["full_bytes"] if c is not None else math.nan
        out.append([
            f"{r['lr']:g}", "yes" if r["identical"] else "NO",
            f"{c:.3%}" if c is not None else "-",
            f"{r['sent_bytes'] / r['full_bytes']:.2%}",
            "yes" if r["sent_bytes"] <= goal else "no",
            *(f"{r[k]:.0f}" for k in ("full_ms_p50", "full_ms_p90", "full_ms_max")),
            *(f"{r[k]:.0f}" for k in ("sent_ms_p50", "sent_ms_p90", "sent_ms_max")),
            f"{r['full_ms_p50'] / r['sent_ms_p50']:.2f}",
            *(f"{r[k]:.0f}" for k in ("measured_ms_p50", "measured_ms_max")),
            f"{r['full_ms_p50'] / r['measured_ms_p50']:.2f}", r["measured_kinds"],
        ])  # fmt: skip
    where = torch.cuda.get_device_name(0) if args.transport in ("cuda_ipc", "broadcast") else (
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})")  # fmt: skip
    full = rows[0]["full_bytes"] if rows else 0
    head = (
        f"{args.model} / {args.scale}: {full / 1e9:.2f} GB bf16 over {args.transport}; "
        f"{args.repeat} updates per lr after {args.warmup}; {where} ({socket.gethostname()}), "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )
    cols = ("lr", "identical", "changed", "sent / full", "bytes goal", "full p50 ms",
            "full p90", "full max", "delta p50 ms", "delta p90", "delta max", "x full",
            "measured p50 ms", "measured max", "x full", "measured kinds")  # fmt: skip
    return head + "\n\n" + table(out, cols)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/weights_delta.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--transport", choices=("gloo", "shm", "cuda_ipc", "broadcast"),
                   default="gloo")  # fmt: skip
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--scale", type=int, default=0, help="divide every width (default: 4 on CPU)")
    p.add_argument("--lr", default="1e-6,1e-5,1e-4")
    p.add_argument("--repeat", type=int, default=6, help="timed updates per lr")
    p.add_argument("--warmup", type=int, default=1, help="untimed updates before, per lr")
    p.add_argument("--delta-base", default="device", choices=("device", "host"))
    p.add_argument("--lora", action="store_true", help="the LoRA rows of _lora_bench too")
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    a = p.parse_args(argv)
    a.scale = a.scale or (4 if a.transport in ("gloo", "shm") else 1)
    rows = run(a)
    print(report(rows, a), flush=True)
    first = next(r for r in rows if r["kind"] == "delta")
    link = first["full_bytes"] / (first["full_ms_p50"] / 1e3) / 1e9
    print("\n" + xor_compression(a, link), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
