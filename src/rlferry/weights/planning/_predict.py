"""Predict a sharded update on a cluster we do not have: bytes per link, the busiest, the time.

The trainer is FSDP2 over ``fsdp`` ranks (rows as ``torch.chunk``), optionally with
tensor parallelism ``tp`` inside (each TP slice then chunked by FSDP); the engines are
``engines`` x TP ``engine_tp`` in ``engine_dtype``. The plan is :class:`ShardPlan`'s,
the same code that moves the bytes. GPUs fill hosts of ``gpus_per_host`` in order,
trainers first; a link within a host runs at ``nvlink_GBps``, across hosts at
``network_GBps`` (per GPU, each direction). The prediction is the busiest GPU's busiest
link: its bytes over its bandwidth (every link runs at once, full duplex, no casts
timed), plus what an update costs besides its bytes:

- ``update_ms``: an update of one trainer rank to one engine rank (its messages, the
  first bucket's pack and the last one's load), with a 4 MB model, where nothing
  hides it;
- ``link_ms`` for each further link of the trainer rank with the most links, and
  again for each further link of the engine rank with the most (each link's pushes
  and loads run in threads of one process, one at a time in its interpreter; within
  20% at 1 to 3 links a side with a GPU a rank and at 4 a side with two ranks a GPU;
  ranks that share a GPU more take turns on it and are slower than this);
- ``bucket_ms`` for each further bucket of the rank that handles the most (every
  link's bucket after its first; its host work is done one bucket at a time). A
  rank's links share ``buffer_bytes`` of buffers (two of a bucket each, at both
  ends: :func:`busier_ends`), so many links a rank mean small buckets, many of
  them: the memory against time trade the prediction shows;
- in block FP8 (``engine_dtype="fp8_block128"``: 1 byte an element and 4 a 128 x 128
  block on the wire), the quantize pass of the trainer rank with the most to quantize
  (each region once, in the trainer's dtype) at ``quantize_GBps``, before its sends.

Layers with the same tensors (names without their layer number, shapes) are
planned once and counted as many times: a 94-layer MoE is planned as one layer.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlferry.errors import RequestError

from ._blocks import QUANTIZE, check_engine_dtype
from ._boxes import Box, chunk_bounds, full_box, volume
from ._budget import (
    LINK_BUFFER_BYTES,
    MIN_BUCKET_BYTES,
    NCCL_PEER_BYTES,
    NCCL_PROCESS_BYTES,
    bucket_cap,
    link_nccl_bytes,
)
from ._layouts import TrainerLayout
from ._shard_plan import ShardPlan
from ._specs import TensorSpec
from ._tp import tp_layout, tp_split_dim

__all__ = [
    "BUCKET_MS",
    "LINK_MS",
    "MAX_BUCKET_BYTES",
    "QUANTIZE_GBPS",
    "UPDATE_MS",
    "WRITE_LINK_MS",
    "WRITE_UPDATE_MS",
    "Cluster",
    "Prediction",
    "predict",
    "representatives",
    "trainer_layout",
]

# What an update costs besides its bytes over NCCL links, measured on four H200s by
# ``python benchmarks/weights_sharded.py --device cuda --transport broadcast
# --point-to-point --scale 64 --senders N --receivers M [--tp T] [--gpus 4]`` (1 to 4
# links a side) and, for the buckets, ``--senders 1 --receivers 1 --scale 2 --bucket-mb
# 4|16|64|256``, checked against the prediction by ``python benchmarks/plan_check.py``:
# a 4 MB update of one trainer rank to one engine rank takes 1.5-1.7 ms; each further
# link of a rank 0.3-0.7 ms more, at either end; each further bucket of a rank 0.09 ms.
UPDATE_MS = 1.5
LINK_MS = 0.55  # for each link of the trainer rank with the most, past its first; again
# for the engine rank with the most
BUCKET_MS = 0.09  # for each bucket of the rank with the most, past each link's first
# The same over cuda_ipc writes within a host (a trainer rank's GPU writes its pieces into
# the engine ranks' tensors: no pack, no load, every bucket announced at once, so no cost a
# bucket): 2 trainer ranks to a TP=2 engine take 0.5-1.0 ms besides the bytes NCCL's own
# send/recv moves (4.1 and 16.4 GB), measured on four H200s by ``python
# benchmarks/weights_sharded.py --device cuda --point-to-point --senders 2 --receivers 2
# --scale 2|1 --transport cuda_ipc --gpus 4`` against ``--transport broadcast --mode
# bound``, checked by ``python benchmarks/plan_check.py``
WRITE_UPDATE_MS = 0.6
WRITE_LINK_MS = 0.15
MAX_BUCKET_BYTES = 256 << 20  # a link's default bucket on a GPU at most (WeightSender's)
# Bytes of bf16 weights a trainer rank's GPU quantizes to block FP8 a second (the Triton
# kernel: each weight read once, its values and scales written once): Qwen3-8B's 252 linear
# weights (13.9 GB) in 9.2 ms on one H200, 1,507 GB/s, measured by ``python
# benchmarks/weights_fp8.py --device cuda --repeat 20`` (a bf16 device copy of the same
# bytes: 7.3 ms)
QUANTIZE_GBPS = 1500.0

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def trainer_layout(specs: Sequence[TensorSpec], fsdp: int, tp: int = 1) -> TrainerLayout:
    """FSDP2 over ``fsdp`` ranks, with tensor parallelism ``tp`` inside: rank
    ``t * fsdp + f`` holds FSDP chunk ``f`` (dim 0) of TP slice ``t`` (the dimension a
    TP layer splits; a replicated tensor is chunked by FSDP only, on TP slice 0)."""
    owned: list[dict[str, Box]] = [{} for _ in range(fsdp * tp)]
    for s in specs:
        d = tp_split_dim(s) if tp > 1 else None
        for t in range(tp if d is not None else 1):
            box = list(full_box(s.shape))
            if d is not None:
                box[d] = chunk_bounds(s.shape[d], tp, t)
            for f in range(fsdp):
                b = list(box)
                if b:
                    lo, hi = b[0]
                    a, z = chunk_bounds(hi - lo, fsdp, f)
                    b[0] = (lo + a, lo + z)
                elif f:
                    continue
                if volume(tuple(b)) or not b:
                    owned[t * fsdp + f][s.name] = tuple(b)
    return TrainerLayout(tuple(specs), tuple(owned))


def representatives(specs: Sequence[TensorSpec]) -> tuple[list[TensorSpec], dict[str, int]]:
    """One layer per group of layers with the same tensors; how many each stands for."""
    layers: dict[int, list[TensorSpec]] = defaultdict(list)
    out: list[TensorSpec] = []
    count: dict[str, int] = {}
    for s in specs:
        m = _LAYER.search(s.name)
        if m is None:
            out.append(s)
            count[s.name] = 1
        else:
            layers[int(m.group(1))].append(s)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, ts in sorted(layers.items()):
        sig = tuple((_LAYER.sub(".layers.L.", t.name), t.shape, t.dtype) for t in ts)
        groups.setdefault(sig, []).append(i)
    for members in groups.values():
        for t in layers[members[0]]:
            out.append(t)
            count[t.name] = len(members)
    return out, count


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Where the ranks are and how fast their links run (GB/s per GPU, each direction)."""

    fsdp: int
    trainer_tp: int = 1
    engines: int
    engine_tp: int
    engine_dtype: torch.dtype | str = torch.float8_e4m3fn  # or "fp8_block128"
    gpus_per_host: int = 8
    nvlink_GBps: float = 450.0  # H100 SXM NVLink 4: 900 GB/s both directions
    network_GBps: float = 50.0  # 400 Gb/s per GPU
    # what an update costs besides its bytes: see UPDATE_MS, LINK_MS and BUCKET_MS
    update_ms: float = UPDATE_MS
    link_ms: float = LINK_MS
    bucket_ms: float = BUCKET_MS
    buffer_bytes: int = LINK_BUFFER_BYTES  # a rank's link buffers together (ShardedSender's)
    quantize_GBps: float = QUANTIZE_GBPS  # block FP8: bytes a trainer rank quantizes a second

    def __post_init__(self) -> None:
        check_engine_dtype(self.engine_dtype, "Cluster.engine_dtype")
        for f in ("fsdp", "trainer_tp", "engines", "engine_tp", "gpus_per_host"):
            v = getattr(self, f)
            if type(v) is not int or v < 1:
                raise RequestError(f"Cluster.{f}: expected an int >= 1, got {v!r}")
        for f in ("nvlink_GBps", "network_GBps", "quantize_GBps"):
            if not getattr(self, f) > 0:
                raise RequestError(
                    f"Cluster.{f}: expected a bandwidth > 0, got {getattr(self, f)!r}"
                )
        for f in ("update_ms", "link_ms", "bucket_ms"):
            if not getattr(self, f) >= 0:
                raise RequestError(f"Cluster.{f}: expected a time >= 0, got {getattr(self, f)!r}")
        if type(self.buffer_bytes) is not int or self.buffer_bytes < 2 * MIN_BUCKET_BYTES:
            raise RequestError(
                f"Cluster.buffer_bytes: expected an int of at least {2 * MIN_BUCKET_BYTES} (two "
                f"buffers of the smallest bucket), got {self.buffer_bytes!r}"
            )


@dataclass(frozen=True)
class Prediction:
    """What a sharded update moves and how long it takes at best."""

    model_bytes: int
    sent_bytes: int  # every link's bytes together (a receiver's own copy of each byte)
    sender_bytes: tuple[int, ...]  # per trainer rank, over all its links
    receiver_bytes: tuple[int, ...]  # per engine rank
    links: int  # (sender, receiver) pairs that carry bytes
    trainer_links: int  # the most links one trainer rank has
    engine_links: int  # the most links one engine rank has
    link_bytes: tuple[int, int, int]  # min, median, max of one link
    buckets: int  # the most buckets one rank handles an update (all its links')
    buffer_bytes: int  # the most one rank's link buffers take
    nccl_bytes: int  # the most device memory NCCL takes in one rank (see link_nccl_bytes)
    busiest: str  # which GPU and direction bounds the update
    busiest_bytes: int
    link_seconds: float  # the busiest link's bytes over its bandwidth
    fixed_seconds: float  # the update's cost for its links, besides the buckets
    bucket_seconds: float  # the further buckets of the rank with the most
    seconds: float  # all four
    quantize_bytes: int = 0  # block FP8: the most a trainer rank quantizes (trainer's dtype)
    quantize_seconds: float = 0.0  # its quantize pass

    def text(self) -> str:
        s, r = self.sender_bytes, self.receiver_bytes
        lo, mid, hi = self.link_bytes
        return "\n".join([
            f"model: {_size(self.model_bytes)} in the trainer's dtype",
            f"sent: {_size(self.sent_bytes)} over {self.links} links (one link: min "
            f"{_size(lo)}, median {_size(mid)}, max {_size(hi)})",
            f"per trainer rank: min {_size(min(s))}, median {_size(statistics.median(s))}, "
            f"max {_size(max(s))}",
            f"per engine rank: min {_size(min(r))}, median {_size(statistics.median(r))}, "
            f"max {_size(max(r))}",
            f"busiest link: {self.busiest}, {_size(self.busiest_bytes)} in "
            f"{self.link_seconds * 1e3:.1f} ms",
            f"buffers: at most {_size(self.buffer_bytes)} a rank; NCCL's own for its links: "
            f"about {_size(self.nccl_bytes)} a rank; buckets: at most {self.buckets} a rank "
            "an update",
            *([f"quantize: at most {_size(self.quantize_bytes)} a trainer rank to block FP8 "
               f"in {self.quantize_seconds * 1e3:.1f} ms"] if self.quantize_bytes else []),
            f"predicted update time: {self.seconds * 1e3:.1f} ms (the busiest link, "
            f"{self.fixed_seconds * 1e3:.1f} ms for up to {self.trainer_links} links a "
            f"trainer rank and {self.engine_links} an engine rank, "
            f"{self.bucket_seconds * 1e3:.1f} ms for the buckets"
            + (f", {self.quantize_seconds * 1e3:.1f} ms to quantize)" if self.quantize_bytes
               else ")"),
        ])  # fmt: skip


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def predict(
    specs: Sequence[TensorSpec],
    cluster: Cluster,
    *,
    encoded: Callable[[int, torch.dtype], int] | None = None,
) -> Prediction:
    """Plan the update of ``specs`` (full tensors, the trainer's dtype) on ``cluster``.
    ``encoded(elements, dtype)``: the bytes a piece of that many elements takes on the
    wire (default: its elements at the dtype's size; a delta push sends fewer)."""
    c = cluster
    reps, count = representatives(specs)
    trainer = trainer_layout(reps, c.fsdp, c.trainer_tp)
    engine = tp_layout(reps, c.engine_tp, replicas=c.engines, dtype=c.engine_dtype)
    plan = ShardPlan.build(trainer, engine)
    n_send, n_recv = trainer.ranks, len(engine.receivers)
    per_link: dict[tuple[int, int], int] = {}
    for (s, r), copies in plan.copies.items():
        total = 0
        for cp in copies:
            piece = plan.piece(s, cp.piece)
            size = (
                cp.elements * piece.dtype.itemsize
                if encoded is None
                else encoded(cp.elements, piece.dtype)
            )
            total += size * count[piece.source]
        per_link[(s, r)] = total
    host_s = [s // c.gpus_per_host for s in range(n_send)]
    host_r = [(n_send + r) // c.gpus_per_host for r in range(n_recv)]
    # per GPU and direction: bytes within the host (NVLink) and across hosts (network)
    load: dict[tuple[str, int, str, str], int] = defaultdict(int)
    for (s, r), b in per_link.items():
        kind = "nvlink" if host_s[s] == host_r[r] else "network"
        load[("trainer rank", s, "out", kind)] += b
        load[("engine rank", r, "in", kind)] += b
    bw = {"nvlink": c.nvlink_GBps * 1e9, "network": c.network_GBps * 1e9}
    (who, i, way, kind), worst = max(load.items(), key=lambda kv: kv[1] / bw[kv[0][3]])
    sender = [sum(b for (s, _), b in per_link.items() if s == k) for k in range(n_send)]
    receiver = [sum(b for (_, r), b in per_link.items() if r == k) for k in range(n_recv)]
    links = sorted(per_link.values())
    t_n = [0] * n_send  # links a rank
    e_n = [0] * n_recv
    for s, r in per_link:
        t_n[s] += 1
        e_n[r] += 1
    fixed = (c.update_ms + c.link_ms * (max(t_n) - 1 + max(e_n) - 1)) / 1e3
    # each link's buckets, small enough that every rank's buffers fit buffer_bytes (as
    # ShardedSender makes them), counted at both ends: a rank's buckets and buffers
    buckets: dict[tuple[int, int], int] = defaultdict(int)  # by (0: trainer, 1: engine; rank)
    buffers: dict[tuple[int, int], int] = defaultdict(int)
    # NCCL's memory at both ends: its own once, a link's group, the host's GPUs reached
    nccl: dict[tuple[int, int], int] = defaultdict(lambda: NCCL_PROCESS_BYTES)
    peers: dict[tuple[int, int], int] = defaultdict(int)
    for (s, r), b in per_link.items():
        busier = max(t_n[s], e_n[r])
        bucket = min(MAX_BUCKET_BYTES, bucket_cap(c.buffer_bytes, busier))
        for end in ((0, s), (1, r)):
            buckets[end] += -(-b // bucket)
            buffers[end] += 2 * min(bucket, b)
            nccl[end] += link_nccl_bytes(busier)
            peers[end] += host_s[s] == host_r[r]
    for end, n in peers.items():
        nccl[end] += min(n, c.gpus_per_host - 1) * NCCL_PEER_BYTES
    # the rank with the most buckets past each link's first (those are in update_ms)
    ends = (t_n, e_n)
    most = max(n - ends[side][k] for (side, k), n in buckets.items())
    specs_by = {t.name: t for t in reps}
    quantize = max(
        sum(volume(p.box) * specs_by[p.source].dtype.itemsize * count[p.source]
            for p in stream if p.quantize == QUANTIZE)
        for stream in plan.streams
    )  # fmt: skip
    q_seconds = quantize / (c.quantize_GBps * 1e9)
    return Prediction(
        model_bytes=sum(s.nbytes for s in specs),
        sent_bytes=sum(links),
        sender_bytes=tuple(sender),
        receiver_bytes=tuple(receiver),
        links=len(links),
        trainer_links=max(t_n),
        engine_links=max(e_n),
        link_bytes=(links[0], links[len(links) // 2], links[-1]),
        buckets=max(buckets.values()),
        buffer_bytes=max(buffers.values()),
        nccl_bytes=max(nccl.values()),
        busiest=f"{who} {i} {way} over {kind} ({bw[kind] / 1e9:g} GB/s)",
        busiest_bytes=worst,
        link_seconds=worst / bw[kind],
        fixed_seconds=fixed,
        bucket_seconds=most * c.bucket_ms / 1e3,
        seconds=worst / bw[kind] + fixed + most * c.bucket_ms / 1e3 + q_seconds,
        quantize_bytes=quantize,
        quantize_seconds=q_seconds,
    )
