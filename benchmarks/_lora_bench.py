"""LoRA rows of the weights benchmark: a LoRA adapter's push against a full push of the model.

Qwen3-8B's names and shapes (``_weights_engine.model_shapes``, every width divided by
``--scale``) in bfloat16, and a rank-16 adapter on every linear layer of the attention and
the MLP (q, k, v, o, gate, up, down of the 36 layers; the rank divided by ``--scale`` too,
at least 1, so the ratio of bytes holds at any scale), named as PEFT saves it, with its
configuration (``rlferry.lora_config``). The engine is another process holding the model's
and the adapter's tensors; a ``WeightSender`` pushes the whole model to it, then the
adapter alone (new values each push, in the trainer's tensors), over ``--transport``:
``gloo`` (between two processes on the CPU: the broadcast transport over gloo), ``shm``,
``cuda_ipc`` (one GPU) or ``broadcast`` (NCCL, two GPUs). Every adapter push is checked:
the engine's adapter must equal the trainer's, bit for bit.

Run by ``benchmarks/weights_delta.py --lora`` (:func:`lora_rows`), or on its own::

    python benchmarks/_lora_bench.py --scale 4 --transport gloo [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from rlferry.engines.lora import CONFIG_NAME, config_tensor, lora_names
from rlferry.weights import ParamLoader, WeightReceiver, WeightSender, fingerprint

import _weights_engine as eng
from _common import receive, start_worker, table

RANK = 16
ALPHA = 32.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TRANSPORTS = {  # --transport: (the sender's transport, the trainer's device, the engine's)
    "gloo": ("broadcast", "cpu", "cpu"),
    "shm": ("shm", "cpu", "cpu"),
    "cuda_ipc": ("cuda_ipc", "cuda:0", "cuda:0"),
    "broadcast": ("broadcast", "cuda:0", "cuda:1"),
}


def adapter_shapes(shapes: eng.Shapes, rank: int) -> eng.Shapes:
    """A and B of every target linear layer of ``shapes``, by PEFT's names."""
    out: eng.Shapes = []
    for name, shape in shapes:
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in TARGETS:
            a, b = lora_names(module)
            out += [(a, (rank, shape[1])), (b, (shape[0], rank))]
    return out


def _engine(base: eng.Shapes, lora: eng.Shapes, device: str, conn: Connection) -> None:
    """The engine process: the model's and the adapter's tensors, a receiver per push kind."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    params = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in base + lora}
    params[CONFIG_NAME] = torch.zeros(3, dtype=torch.float32, device=device)
    adapter = [n for n, _ in lora] + [CONFIG_NAME]
    recv: WeightReceiver | None = None
    conn.send(("ok", "ready"))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "join":
            if recv is not None:
                recv.close()
            address, group = args
            recv = WeightReceiver(
                group=group, address=address, load=ParamLoader(params), expected=params,
                name="engine", device=device if device.startswith("cuda") else None,
            ).start()  # fmt: skip
            conn.send(("ok", recv.name))
        elif cmd == "adapter":  # the digest of the adapter it holds
            conn.send(("ok", fingerprint((n, params[n]) for n in adapter)))
    if recv is not None:
        recv.close()


def _make(shapes: eng.Shapes, device: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [
        (n, torch.empty(s, dtype=torch.bfloat16, device=device).normal_(generator=g))
        for n, s in shapes
    ]


def _pushes(
    engine: Callable[..., Any], transport: str, group: str, updates: list[Any], warmup: int
) -> tuple[list[float], int, bool]:
    """Push each of ``updates`` (named tensors) through a new sender of ``group``; the
    seconds of the pushes after ``warmup``, the bytes of one, and whether every adapter
    the engine held after a push was the trainer's."""
    sender = WeightSender(group=group, transport=transport, receivers=1)
    try:
        engine("join", sender.address, group)
        times, nbytes, identical = [], 0, True
        for version, named in enumerate(updates, 1):
            if group.endswith("lora"):  # a training step: new values, the same tensors
                g = torch.Generator(device=named[0][1].device).manual_seed(version)
                for _, t in named[:-1]:
                    t.normal_(generator=g)
            t0 = time.perf_counter()
            nbytes = sender.push(named, version=version, timeout=600).bytes
            times.append(time.perf_counter() - t0)
            if group.endswith("lora"):
                identical &= engine("adapter") == fingerprint(named)
    finally:
        sender.close()
    return sorted(times[warmup:]), nbytes, identical


def lora_rows(args: Any) -> list[dict[str, Any]]:
    """The LoRA row of ``args.transport`` (``gloo``, ``shm``, ``cuda_ipc``, ``broadcast``)
    at ``args.scale``, ``args.repeat`` timed pushes of each kind (default 5) after two
    warm-up pushes (the first sends the plan and forms the group)."""
    scale = int(getattr(args, "scale", 0) or 4)
    repeat = int(getattr(args, "repeat", 5) or 5)
    which = getattr(args, "transport", "gloo")
    transport, device, engine_device = TRANSPORTS[which]
    rank = max(1, RANK // scale)
    base = eng.model_shapes("qwen3-8b", scale)
    lora = adapter_shapes(base, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    proc, conn = start_worker(mp.get_context("spawn"), _engine, base, lora, engine_device)

    def engine(*cmd: Any) -> Any:
        if cmd:
            conn.send(cmd)
        status, value = receive(conn, f"the engine's answer to {cmd[:1]}")
        if status != "ok":
            raise RuntimeError(f"engine: {value}")
        return value

    try:
        engine()  # ready
        warmup = 2
        model = _make(base, device, 0)
        full = _pushes(engine, transport, "bench-full", [model] * (warmup + repeat), warmup)
        del model
        # the trainer's adapter, where it trains: each push a new one, written in place
        adapter = [*_make(lora, device, 0), (CONFIG_NAME, config_tensor(rank, ALPHA).to(device))]
        sent = _pushes(engine, transport, "bench-lora", [adapter] * (warmup + repeat), warmup)
    finally:
        conn.send(("stop",))
        proc.join(60)
    p50 = lambda t: 1e3 * t[len(t) // 2]  # noqa: E731
    return [{
        "transport": which, "lr": None, "kind": "lora", "identical": sent[2],
        "changed_fraction": None, "full_bytes": full[1], "sent_bytes": sent[1],
        "full_ms_p50": p50(full[0]), "sent_ms_p50": p50(sent[0]),
        "rank": rank, "scale": scale,
    }]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/_lora_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--transport", choices=tuple(TRANSPORTS), default="gloo")
    p.add_argument("--scale", type=int, default=4, help="divide every width and the rank")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None, help="write the rows there")
    a = p.parse_args(argv)
    rows = lora_rows(a)
    r = rows[0]
    print(f"Qwen3-8B shapes / {r['scale']}, LoRA rank {r['rank']} on q,k,v,o,gate,up,down, "
          f"{a.transport}, p50 of {a.repeat} pushes each\n")  # fmt: skip
    print(table([[
        r["transport"], f"{r['full_bytes'] / 1e6:.1f}", f"{r['sent_bytes'] / 1e6:.2f}",
        f"{r['full_bytes'] / r['sent_bytes']:.0f}x", f"{r['full_ms_p50']:.1f}",
        f"{r['sent_ms_p50']:.2f}", f"{r['full_ms_p50'] / r['sent_ms_p50']:.0f}x",
        str(r["identical"]),
    ]], ["transport", "full push MB", "LoRA push MB", "fewer bytes", "full push ms (p50)",
         "LoRA push ms (p50)", "faster", "adapter identical"]))  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if not all(row["identical"] for row in rows):
        sys.exit("the engine's adapter differs from the trainer's")


if __name__ == "__main__":
    main()
