"""The floors of ``benchmarks/weights_sharded.py``: what a sharded update would take with
no control plane, in one communicator of every rank (trainer ranks ``0..S-1``, then engine
ranks), each rank's links in one batched send or receive a round.

``--mode bound``: NCCL's (gloo's) own batched send and receive of exactly each
point-to-point link's bytes, one buffer a link; nothing packed, loaded or planned.

``--mode batched``: the same with rlferry's data path around it: a trainer rank packs
every link's pieces (views of its shards, cut as the plan says) into its link buffers
with one grouped copy, then sends; an engine rank receives, then copies its parts of
every link's pieces into its parameters with one grouped copy. Whole links, one buffer
each (no buckets: buffers as large as the links). Its engines check their parameters at
the end, as the sharded mode's do. What a design with one communicator and one batched
round a rank per update could reach; the parent's message starts each round (no
rlferry message).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from rlferry.weights import GroupedCopy, ShardPlan
from rlferry.weights._boxes import extents, relative, slices

from weights_sharded import WAIT, _recv, _start, device_of, expected_params, layouts, local_shards

_ALIGN = 256


def _layout_of(pieces: list[Any]) -> tuple[list[int], int]:
    """Each piece's byte offset in its link's buffer (aligned), and the buffer's size."""
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += -(-p.nbytes // _ALIGN) * _ALIGN
    return offsets, max(at, _ALIGN)


def _view(buf: torch.Tensor, at: int, piece: Any) -> torch.Tensor:
    return buf[at : at + piece.nbytes].view(piece.dtype).view(extents(piece.box))


def _floor(rank: int, args: argparse.Namespace, port: int, conn: Connection) -> None:
    trainer, engine = layouts(args)
    plan = ShardPlan.build(trainer, engine)
    s_n = args.senders
    role, me = ("trainer", rank) if rank < s_n else ("engine", rank - s_n)
    dev = torch.device(device_of(args, role, me))
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, s_n + args.receivers, rank == 0,
                          timeout=datetime.timedelta(seconds=WAIT))  # fmt: skip
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=s_n + args.receivers,
        device_id=dev if cuda else None,
    )  # fmt: skip
    peers = plan.receivers_of(me) if role == "trainer" else plan.senders_of(me)
    links = {p: plan.link(me, p) if role == "trainer" else plan.link(p, me) for p in peers}
    bufs: dict[int, torch.Tensor] = {}
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    mine = local_shards(args, trainer, me, str(dev)) if role == "trainer" else {}
    params = (
        {n: torch.zeros(s.shape, dtype=s.dtype, device=dev)
         for n, s in engine.param_specs(me).items()}
        if role == "engine" else {}
    )  # fmt: skip
    for p, (pieces, copies) in links.items():
        offsets, size = _layout_of(pieces)
        buf = bufs[p] = torch.empty(size, dtype=torch.uint8, device=dev)
        views = {q.name: _view(buf, at, q) for q, at in zip(pieces, offsets, strict=True)}
        if role == "trainer":
            owned = trainer.owned[me]
            for q in pieces:
                src = mine[q.source][slices(relative(q.box, owned[q.source]))]
                dsts.append(views[q.name])
                srcs.append(src if src.dtype == q.dtype else src.to(q.dtype))
        else:
            for c in copies:
                dst = params[c.param][slices(c.at)]
                src = views[c.piece][slices(c.within)]
                dsts.append(dst)
                same = extents(c.within) == tuple(dst.shape)
                srcs.append(src if same else src.reshape(dst.shape))
    copy = GroupedCopy(dsts, srcs) if args.mode == "batched" and dsts else None
    op = dist.isend if role == "trainer" else dist.irecv
    sent = sum(b.numel() for b in bufs.values()) if args.mode == "batched" else 0
    if args.mode == "bound":  # exactly each link's bytes
        sizes = {p: plan.link_bytes(me, p) if role == "trainer" else 0 for p in peers}
        sent = sum(sizes.values())
    conn.send(("ready", None))
    while (msg := conn.recv()) != "stop":
        if copy is not None and role == "trainer":
            copy()  # pack every link's pieces
        ops = [dist.P2POp(op, b, p if role == "engine" else s_n + p) for p, b in bufs.items()]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        if copy is not None and role == "engine":
            copy()  # load every link's pieces
        if cuda:
            torch.cuda.synchronize(dev)
        conn.send(("pushed", sent, 0) if role == "trainer" else ("at", msg))
    same = True
    if role == "engine" and copy is not None:
        want = expected_params(args, engine, trainer, me, str(dev))
        same = all(torch.equal(want[n], params[n]) for n in want)
    conn.send(("identical", same, 0))
    dist.destroy_process_group()


def run_floor(args: argparse.Namespace) -> tuple[list[float], list[int], bool]:
    """Time ``--mode bound`` or ``batched`` as the other modes are timed: the parent's
    send to the last engine's receipt. Returns seconds per round, bytes per trainer rank
    and whether every engine's parameters came out right (bound: True)."""
    ctx = mp.get_context("spawn")
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    procs = [_start(ctx, _floor, r, args, port) for r in range(args.senders + args.receivers)]
    for _, c in procs:
        _recv(c, "start")
    trainers, engines = procs[: args.senders], procs[args.senders :]
    seconds, sent = [], [0] * args.senders
    for v in range(1, args.updates + 1):
        t = time.perf_counter()
        for _, c in procs:
            c.send(v)
        for _, c in engines:
            assert _recv(c, f"receipt of round {v}") == v
        seconds.append(time.perf_counter() - t)
        for i, (_, c) in enumerate(trainers):
            sent[i] = _recv(c, "send report")[0]
    for _, c in procs:
        c.send("stop")
    same = True
    for proc, c in procs:
        same = _recv(c, "end")[0] and same
        proc.join(60)
    return seconds, sent, same
