"""The floors of ``benchmarks/weights_sharded.py``: what a sharded update would take with
no control plane, in one communicator of every rank (trainer ranks ``0..S-1``, then engine
ranks), each rank's links in one batched send or receive a round.

``--mode bound``: NCCL's (gloo's) own batched send and receive of exactly each
point-to-point link's bytes, one buffer a link; nothing packed, loaded or planned.

``--mode control``: ``batched`` with the least control a version needs: each trainer rank
tells each engine rank it feeds that version v starts (a ZeroMQ message), every engine
rank's one thread waits for all its trainer ranks' messages, receives and loads the
rounds, then tells each of them it committed; a trainer rank's update ends with its
engine ranks' commits. The parent starts only the trainer ranks. What a one-communicator
design would take with a real start and commit (one thread a rank, no plan checks).

Every rank prints the device memory it took outside torch's allocator (NCCL's
communicator and its connections to its peers) once the updates ran.

``--mode batched``: the same with rlferry's data path around it, in rounds of
``--bucket-mb`` (default 256, rlferry's bucket on a GPU): a trainer rank packs a round's
pieces of every link (views of its shards, cut as the plan says) with one grouped copy
and sends them in one batched round, the next round's pack running beside the sends; an
engine rank receives each round and copies its parts of the round's pieces into its
parameters with one grouped copy, beside the next round's receive. A whole buffer a
link (no buffer reused: the floor, not a memory budget). Its engines check their
parameters at the end, as the sharded mode's do. What a design with one communicator
and one batched round a rank and bucket could reach; the parent's message starts an
update (no rlferry message).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from rlferry.weights.copies import GroupedCopy
from rlferry.weights.planning import ShardPlan
from rlferry.weights.planning._boxes import extents, relative, slices

from _common import start_worker
from weights_sharded import (
    WAIT,
    _recv,
    device_of,
    expected_params,
    layouts,
    local_shards,
    outside_before,
    report_outside,
)

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


_Rounds = tuple[list[dict[int, torch.Tensor]], list[GroupedCopy | None], dict[str, torch.Tensor]]


def _batched(
    args: argparse.Namespace, plan: ShardPlan, trainer: Any, engine: Any, role: str, me: int,
    peers: list[int], dev: torch.device,
) -> _Rounds:  # fmt: skip
    """A whole buffer a link (the floor: no buffer reused, no memory budget), its pieces
    laid out in order; a piece belongs to the round of ``--bucket-mb`` (default 256) its
    offset falls in, and a round moves each link's range of its pieces. Returns each
    round's ranges by peer (views of the link buffers), its grouped copy (the pack of its
    pieces, or their load) and, for an engine rank, its parameters."""
    bucket = (args.bucket_mb or 256) << 20
    mine = local_shards(args, trainer, me, str(dev)) if role == "trainer" else {}
    params = (
        {n: torch.zeros(s.shape, dtype=s.dtype, device=dev)
         for n, s in engine.param_specs(me).items()}
        if role == "engine" else {}
    )  # fmt: skip
    ranges: dict[int, dict[int, torch.Tensor]] = {}  # round -> peer -> its bytes
    pairs: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for p in peers:
        pieces, cps = plan.link(me, p) if role == "trainer" else plan.link(p, me)
        offsets, size = _layout_of(pieces)
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
        views = {q.name: _view(buf, at, q) for q, at in zip(pieces, offsets, strict=True)}
        round_of = {q.name: at // bucket for q, at in zip(pieces, offsets, strict=True)}
        ends = [*offsets[1:], size]
        for k in sorted(set(round_of.values())):
            at = [i for i, q in enumerate(pieces) if round_of[q.name] == k]
            ranges.setdefault(k, {})[p] = buf[offsets[at[0]] : ends[at[-1]]]
        if role == "trainer":
            owned = trainer.owned[me]
            for q in pieces:
                src = mine[q.source][slices(relative(q.box, owned[q.source]))]
                d, s_ = pairs.setdefault(round_of[q.name], ([], []))
                d.append(views[q.name])
                s_.append(src if src.dtype == q.dtype else src.to(q.dtype))
        else:
            for c in cps:
                dst = params[c.param][slices(c.at)]
                src = views[c.piece][slices(c.within)]
                d, s_ = pairs.setdefault(round_of[c.piece], ([], []))
                d.append(dst)
                same = extents(c.within) == tuple(dst.shape)
                s_.append(src if same else src.reshape(dst.shape))
    keys = sorted(ranges)
    copies = [GroupedCopy(*pairs[k]) if k in pairs else None for k in keys]
    return [ranges[k] for k in keys], copies, params


def _floor(rank: int, args: argparse.Namespace, port: int, conn: Connection) -> None:
    trainer, engine = layouts(args)
    plan = ShardPlan.build(trainer, engine)
    s_n = args.senders
    role, me = ("trainer", rank) if rank < s_n else ("engine", rank - s_n)
    dev = torch.device(device_of(args, role, me))
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    free, reserved = outside_before(dev)
    store = dist.TCPStore("127.0.0.1", port, s_n + args.receivers, rank == 0,
                          timeout=datetime.timedelta(seconds=WAIT))  # fmt: skip
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=s_n + args.receivers,
        device_id=dev if cuda else None,
    )  # fmt: skip
    peers = plan.receivers_of(me) if role == "trainer" else plan.senders_of(me)
    peer_rank = {p: p if role == "engine" else s_n + p for p in peers}
    op = dist.isend if role == "trainer" else dist.irecv
    # by round: each link's bytes of it, and the grouped copy of its pieces (pack or load)
    rounds: list[dict[int, torch.Tensor]] = []
    copies: list[GroupedCopy | None] = []
    sent = 0
    if args.mode == "bound":  # exactly each link's bytes, one round
        sizes = {p: plan.link_bytes(me, p) if role == "trainer" else plan.link_bytes(p, me)
                 for p in peers}  # fmt: skip
        rounds = [{p: torch.empty(n, dtype=torch.uint8, device=dev) for p, n in sizes.items() if n}]
        copies = [None]
        sent = sum(sizes.values()) if role == "trainer" else 0
        params: dict[str, torch.Tensor] = {}
    else:
        rounds, copies, params = _batched(args, plan, trainer, engine, role, me, peers, dev)
        if role == "trainer":
            sent = sum(b.numel() for links in rounds for b in links.values())
    ctl = _Control(port, role, me, peers) if args.mode == "control" else None
    conn.send(("ready", None))
    if ctl is not None and role == "engine":  # started by its trainer ranks, not the parent
        for _ in range(args.updates):
            v = ctl.starts()
            _rounds(rounds, copies, role, op, peer_rank, cuda, dev)
            ctl.tell(v)
            conn.send(("at", v))
        assert conn.recv() == "stop"
    else:
        while (msg := conn.recv()) != "stop":
            if ctl is not None:
                ctl.tell(msg)
            _rounds(rounds, copies, role, op, peer_rank, cuda, dev)
            if ctl is not None:
                ctl.commits(msg)
            conn.send(("pushed", sent, 0) if role == "trainer" else ("at", msg))
    report_outside(
        dev, free, reserved, f"{role} rank {me} ({len(peers)} peers, --mode {args.mode})"
    )
    same = True
    if role == "engine" and args.mode != "bound":
        want = expected_params(args, engine, trainer, me, str(dev))
        same = all(torch.equal(want[n], params[n]) for n in want)
    conn.send(("identical", same, 0))
    if ctl is not None:
        ctl.close()
    dist.destroy_process_group()


def _rounds(
    rounds: list[dict[int, torch.Tensor]], copies: list[GroupedCopy | None], role: str,
    op: Any, peer_rank: dict[int, int], cuda: bool, dev: torch.device,
) -> None:  # fmt: skip
    """One update's rounds: pack, one batched send or receive a round, load; then the
    device is synchronized."""
    works = []
    for links, copy in zip(rounds, copies, strict=True):
        if copy is not None and role == "trainer":
            copy()  # pack this round's pieces of every link
        ops = [dist.P2POp(op, b, peer_rank[p]) for p, b in links.items()]
        works.append(dist.batch_isend_irecv(ops) if ops else [])
    for ws, copy in zip(works, copies, strict=True):
        for w in ws:
            w.wait()
        if copy is not None and role == "engine":
            copy()  # load this round's pieces of every link
    if cuda:
        torch.cuda.synchronize(dev)


class _Control:
    """``--mode control``'s messages: a PULL socket a rank (ipc://, named by the run's
    port), a PUSH socket to each peer. A trainer rank tells its engine ranks a version
    starts, and they tell it they committed it."""

    def __init__(self, port: int, role: str, me: int, peers: list[int]) -> None:
        import zmq

        other = "engine" if role == "trainer" else "trainer"
        path = lambda r, k: f"ipc:///tmp/rlferry-floor-{port}-{r}{k}"  # noqa: E731
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(path(role, me))
        self._own = path(role, me)[len("ipc://") :]
        self._push = []
        for p in peers:
            s = self._ctx.socket(zmq.PUSH)
            s.connect(path(other, p))
            self._push.append(s)
        self._peers = len(peers)

    def tell(self, version: int) -> None:
        msg = version.to_bytes(8, "little")
        for s in self._push:
            s.send(msg)

    def _gather(self) -> int:
        got = {int.from_bytes(self._pull.recv(), "little") for _ in range(self._peers)}
        assert len(got) == 1, got
        return got.pop()

    def starts(self) -> int:
        """The version every trainer rank of this engine rank started (blocks for them)."""
        return self._gather()

    def commits(self, version: int) -> None:
        """Blocks until every engine rank this trainer rank feeds committed ``version``."""
        assert self._gather() == version

    def close(self) -> None:
        self._ctx.destroy(linger=0)
        if os.path.exists(self._own):
            os.unlink(self._own)


def run_floor(args: argparse.Namespace) -> tuple[list[float], list[int], bool]:
    """Time ``--mode bound`` or ``batched`` as the other modes are timed: the parent's
    send until every engine's receipt and every trainer's report. Returns seconds per
    round, bytes per trainer rank and whether every engine's parameters came out right
    (bound: True)."""
    ctx = mp.get_context("spawn")
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    procs = [start_worker(ctx, _floor, r, args, port) for r in range(args.senders + args.receivers)]
    for _, c in procs:
        _recv(c, "start")
    trainers, engines = procs[: args.senders], procs[args.senders :]
    seconds, sent = [], [0] * args.senders
    for v in range(1, args.updates + 1):
        t = time.perf_counter()
        for _, c in trainers if args.mode == "control" else procs:
            c.send(v)
        for _, c in engines:
            assert _recv(c, f"receipt of round {v}") == v
        for i, (_, c) in enumerate(trainers):
            sent[i] = _recv(c, "send report")[0]
        seconds.append(time.perf_counter() - t)  # both ends done, as the sharded mode's
    for _, c in procs:
        c.send("stop")
    same = True
    for proc, c in procs:
        same = _recv(c, "end")[0] and same
        proc.join(60)
    return seconds, sent, same
