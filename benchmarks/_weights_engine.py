"""The weights benchmark's parts: model shapes, the fake engine process, the baselines.

The engine is a process holding preallocated parameters of the model's shapes;
every way of moving weights (rlferry and each baseline) ends in a copy into
them, as an engine's ``load_weights`` does. It takes commands on a pipe.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from rlferry.weights import ParamLoader, WeightReceiver
from rlferry.weights.planning import TensorSpec
from rlferry.weights.planning._buckets import Plan
from rlferry.weights.transports._cuda_shared import open_shared, share

from _common import receive

Shapes = list[tuple[str, tuple[int, ...]]]


def qwen3_dense(layers: int, hidden: int, inter: int, heads: int, kv: int, head: int,
                vocab: int) -> Shapes:  # fmt: skip
    """Hugging Face names and shapes of a Qwen3 dense model (untied lm_head)."""
    out: Shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += _attention(p, hidden, heads, kv, head)
        out += [
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    return [*out, ("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def qwen3_moe(layers: int, hidden: int, inter: int, experts: int, heads: int, kv: int, head: int,
              vocab: int) -> Shapes:  # fmt: skip
    """Hugging Face names and shapes of a Qwen3 MoE model: one tensor per expert projection."""
    out: Shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += _attention(p, hidden, heads, kv, head)
        out.append((p + "mlp.gate.weight", (experts, hidden)))
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out += [
                (q + "gate_proj.weight", (inter, hidden)),
                (q + "up_proj.weight", (inter, hidden)),
                (q + "down_proj.weight", (hidden, inter)),
            ]
    return [*out, ("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def _attention(p: str, hidden: int, heads: int, kv: int, head: int) -> Shapes:
    return [
        (p + "input_layernorm.weight", (hidden,)),
        (p + "self_attn.q_proj.weight", (heads * head, hidden)),
        (p + "self_attn.k_proj.weight", (kv * head, hidden)),
        (p + "self_attn.v_proj.weight", (kv * head, hidden)),
        (p + "self_attn.o_proj.weight", (hidden, heads * head)),
        (p + "self_attn.q_norm.weight", (head,)),
        (p + "self_attn.k_norm.weight", (head,)),
        (p + "post_attention_layernorm.weight", (hidden,)),
    ]


def model_shapes(model: str, scale: int = 1) -> Shapes:
    """``qwen3-8b`` (399 tensors, 16.38 GB bf16), ``qwen3-30b-a3b`` (18,867, 61.06 GB) or
    ``qwen3-0.6b-demo`` (the demo's: 311 tensors, 0.88 GB);
    ``scale`` divides every width (not the counts): 4 makes the 8B about 1 GB."""
    s = scale
    if model == "qwen3-8b":
        return qwen3_dense(36, 4096 // s, 12288 // s, 32, 8, 128 // s, 151936 // s)
    if model == "qwen3-30b-a3b":
        return qwen3_moe(48, 2048 // s, 768 // s, 128, 32, 4, 128 // s, 151936 // s)
    if model == "qwen3-0.6b-demo":  # the demo's model: Qwen3-0.6B, the task's 13 ids
        return qwen3_dense(28, 1024 // s, 3072 // s, 16, 8, 128 // s, 13)
    raise ValueError(f"--model: expected qwen3-8b, qwen3-30b-a3b or qwen3-0.6b-demo, got {model!r}")


def make_state(shapes: Shapes, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        n: torch.empty(s, dtype=torch.bfloat16, device=device).normal_(generator=g)
        for n, s in shapes
    }


def fingerprint(tensors: list[torch.Tensor]) -> int:
    """An exact checksum of bf16 tensors: equal values give equal sums."""
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device)
    for t in tensors:
        total += t.view(torch.int16).sum(dtype=torch.int64)
    return int(total.item())


def specs_of(shapes: Shapes) -> list[TensorSpec]:
    return [TensorSpec(n, s, torch.bfloat16) for n, s in shapes]


class _Views:
    """Typed views of one bucket of a plan in a byte buffer (no split tensors)."""

    def __init__(self, plan: Plan) -> None:
        self.by_bucket = plan.by_bucket()
        self.specs = plan.specs
        assert not plan.split(), "baselines need buckets at least as large as every tensor"

    def views(self, k: int, buf: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
        names, views = [], []
        for c in self.by_bucket[k]:
            s = self.specs[c.tensor]
            names.append(s.name)
            views.append(buf[c.offset : c.offset + c.length].view(s.dtype).view(s.shape))
        return names, views


# -- the engine process ---------------------------------------------------------------------


def engine_main(shapes: Shapes, device: str, conn: Connection) -> None:
    """Runs in its own process: preallocated parameters, commands from ``conn``.

    rlferry's receiver loads with ``ParamLoader`` (one grouped copy per bucket;
    ``kind="grouped64"``: at most 64 programs, beside NCCL) or, ``kind="per_tensor"``,
    one ``_foreach_copy_`` per bucket."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    params = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in shapes}

    def per_tensor(items: list[tuple[str, torch.Tensor]]) -> None:
        torch._foreach_copy_([params[n] for n, _ in items], [t for _, t in items])

    def load(kind: str) -> Callable[[list[tuple[str, torch.Tensor]]], None]:
        if kind == "per_tensor":
            return per_tensor
        return ParamLoader(params, programs=64 if kind == "grouped64" else None)

    handlers: dict[str, Callable[..., Any]] = {
        "rlferry": lambda address, group, name, kind: _serve_rlferry(
            conn, address, group, load(kind), device, name
        ),
        "ipc": lambda bucket, reopen: _ipc_receive(conn, shapes, params, bucket, reopen),
        "nccl_init": lambda port: _nccl_init(port, 1, device),
        "nccl_per_tensor": lambda: _nccl_per_tensor(list(params.values()), rank=1),
        "nccl_packed": lambda bucket: _nccl_packed(shapes, params, bucket, 1, device),
        "nccl_raw": lambda nbytes: _nccl_raw(nbytes, 1, device),
        "fingerprint": lambda: fingerprint(list(params.values())),
        "zero": lambda: [p.zero_() for p in params.values()] and None,
    }
    conn.send(("ok", "ready"))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            return
        conn.send(("ok", handlers[cmd](*args)))


def _serve_rlferry(
    conn: Connection, address: str, group: str, load: Callable[..., None], device: str, name: str
) -> None:
    dev = device if device.startswith("cuda") else None
    with WeightReceiver(group=group, address=address, load=load, device=dev, name=name):
        conn.send(("ok", "joined"))
        conn.recv()  # until the sender is done


# -- baseline: ping-pong CUDA IPC buckets, handles per bucket or cached (NeMo-RL style) ----------


def ipc_send(conn: Connection, state: dict[str, torch.Tensor], bucket: int, reopen: bool,
             buffers: int) -> None:  # fmt: skip
    """Pack buckets into ``buffers`` buffers; per bucket send the buffer's IPC handle
    (``reopen``: a fresh export the receiver opens and closes, as NeMo-RL does) or its index;
    wait for the receiver's ack of the bucket that last used the buffer."""
    from rlferry.weights.copies._pack import Packer, bucketed

    plan = Plan.build(specs_of([(n, tuple(t.shape)) for n, t in state.items()]), bucket)
    dev = next(iter(state.values())).device
    shim = _Shim([torch.empty(plan.buffer_bytes, dtype=torch.uint8, device=dev)
                  for _ in range(buffers)])  # fmt: skip
    packer = Packer(plan, shim, dev)
    if not reopen:
        conn.send([share(b) for b in shim.bufs])
    outstanding = 0
    for k, tensors in bucketed(plan, state.items(), False):
        b = k % buffers
        if k >= buffers:  # the ack of bucket k - buffers: this buffer is free
            receive(conn, f"the engine's ack of bucket {k - buffers}")
            outstanding -= 1
        packer.pack(k, tensors)
        torch.cuda.current_stream(dev).synchronize()
        conn.send((k, b, share(shim.bufs[b]) if reopen else None))
        outstanding += 1
    for _ in range(outstanding):
        receive(conn, "the engine's ack of a bucket")
    conn.send(None)


class _Shim:
    """The bucket buffers a Packer packs into (a ``BucketBuffers``), for the baselines."""

    generation = 0
    collective = False

    def __init__(self, bufs: list[torch.Tensor]) -> None:
        self.bufs = bufs

    def buffer(self, b: int) -> torch.Tensor:
        return self.bufs[b % len(self.bufs)]


def _ipc_receive(conn: Connection, shapes: Shapes, params: dict[str, torch.Tensor], bucket: int,
                 reopen: bool) -> None:  # fmt: skip
    views = _Views(Plan.build(specs_of(shapes), bucket))
    dev = torch.cuda.current_device()
    cached = None if reopen else [open_shared(f, dev) for f in conn.recv()]
    while True:
        msg = conn.recv()
        if msg is None:
            return
        k, b, fields = msg
        buf = open_shared(fields, dev) if reopen else cached[b]  # type: ignore[index]
        names, src = views.views(k, buf)
        torch._foreach_copy_([params[n] for n in names], src)
        torch.cuda.current_stream().synchronize()
        del buf, src  # reopen: the mapping closes here
        conn.send(k)


# -- baselines over NCCL ------------------------------------------------------------------------


def _nccl_init(port: int, rank: int, device: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        device_id=torch.device(device),
    )  # fmt: skip
    t = torch.zeros(1, device=device)
    dist.broadcast(t, 0)
    torch.cuda.synchronize()


def _nccl_per_tensor(tensors: list[torch.Tensor], rank: int) -> None:
    """AReaL/slime style: one broadcast per tensor, straight into the parameter."""
    import torch.distributed as dist

    for t in tensors:
        dist.broadcast(t, 0)
    torch.cuda.synchronize()


def _nccl_packed(shapes: Shapes, params: dict[str, torch.Tensor], bucket: int, rank: int,
                 device: str, state: dict[str, torch.Tensor] | None = None) -> None:  # fmt: skip
    """Packed buckets, no overlap: pack, broadcast, unpack, one bucket after the other."""
    import torch.distributed as dist

    plan = Plan.build(specs_of(shapes), bucket)
    views = _Views(plan)
    buf = torch.empty(plan.buffer_bytes, dtype=torch.uint8, device=device)
    src = list(state.values()) if state is not None else []
    for k, chunks in enumerate(views.by_bucket):
        names, vs = views.views(k, buf)
        if rank == 0:
            torch._foreach_copy_(vs, [src[c.tensor] for c in chunks])
        dist.broadcast(buf[: plan.bucket_used[k]], 0)
        if rank != 0:
            torch._foreach_copy_([params[n] for n in names], vs)
    torch.cuda.synchronize()


def _nccl_raw(nbytes: int, rank: int, device: str) -> None:
    import torch.distributed as dist

    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dist.broadcast(buf, 0)
    torch.cuda.synchronize()
