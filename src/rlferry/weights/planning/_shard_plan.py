"""The plan of a sharded update: which bytes each trainer rank sends, and where they go.

Built from a :class:`TrainerLayout` (what each rank owns) and an
:class:`EngineLayout` (what each receiver needs), both plain boxes:

- every needed box is cut by the owned boxes of its tensor; the pieces must cover it
  exactly once (a byte nobody owns, or two ranks own, is an error naming both);
- each sender's **stream** is a disjoint cover of what its receivers need of what it
  owns, per wire dtype: receivers that need the same bytes (replicas, replicated
  norms) share one piece, so a sender sends each needed byte once; pieces that tile
  the whole shard (the usual case: engines need every byte) are sent as the shard
  itself, one contiguous tensor that shm and cuda_ipc pass without a copy;
- each (sender, receiver) **link** is a list of copies: a box of a piece into a box
  of an engine parameter.

No byte passes through a rank that does not own it and no gather is ever needed:
boxes intersect into boxes. Layouts that are not boxes (a ``Partial`` placement, a
strided shard) are refused when the layout is built. The plan is a pure function of
the two layouts' fingerprints, so senders and receivers compute the same one apart.
A tensor is sent in the engine's dtype when that is no wider than the trainer's
(bf16 -> fp8 narrows the bytes on the wire), else in the trainer's. A tensor the engine
keeps in block FP8 goes as two pieces a box: its values (``float8_e4m3fn``) and their
scales (float32, one per 128 x 128 block), quantized by the rank that owns the box; so
each box a rank sends must be whole blocks, or a ``BlockFP8Error`` names the rank whose
shard cuts a block (one rank cannot scale a block it holds part of).
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from rlferry.errors import RequestError

from .._errors import BlockFP8Error
from ._blocks import BLOCK, BLOCK_FP8, aligned, block_box, scale_name
from ._boxes import Box, box_str, cover, extents, full_box, intersect, relative, shift, volume
from ._layouts import EngineLayout, TrainerLayout
from ._specs import TensorSpec, dtype_name

__all__ = ["SCALES", "Copy", "Piece", "ShardPlan", "wire_dtype"]

Wire = tuple[Box, torch.dtype, str | None]  # a needed box, its wire dtype, its quantize


def wire_dtype(source: torch.dtype, param: torch.dtype) -> torch.dtype:
    """The dtype a source tensor travels in to a parameter of dtype ``param``."""
    return param if param.itemsize <= source.itemsize else source


SCALES = "scales"  # Piece.quantize of a block-FP8 piece's scales


@dataclass(frozen=True)
class Piece:
    """One tensor of a sender's stream: box ``box`` of ``source``, in ``dtype``.
    ``quantize``: ``"block128"``, the box quantized to block FP8 (its values); ``"scales"``,
    their scales (float32, the box's blocks: ``shape`` is in blocks); None, a copy or cast."""

    name: str
    source: str
    box: Box
    dtype: torch.dtype
    quantize: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return extents(block_box(self.box) if self.quantize == SCALES else self.box)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.shape, self.dtype)

    def scales(self) -> Piece:
        """A block-FP8 piece's scales, the piece that follows it in a stream."""
        return Piece(f"{self.name}:scale_inv", self.source, self.box, torch.float32, SCALES)


@dataclass(frozen=True)
class Copy:
    """On a receiver: box ``within`` of piece ``piece`` goes to box ``at`` of ``param``."""

    piece: str
    within: Box
    param: str
    at: Box

    @property
    def elements(self) -> int:
        return volume(self.within)


class ShardPlan:
    """The plan for one pair of layouts: ``streams[s]`` (the pieces sender ``s`` pushes,
    in order) and ``copies[(s, r)]`` (what receiver ``r`` takes of them). Build it with
    :meth:`build`; ``fingerprint`` is that of the two layouts together."""

    def __init__(
        self,
        trainer: TrainerLayout,
        engine: EngineLayout,
        streams: tuple[tuple[Piece, ...], ...],
        copies: dict[tuple[int, int], tuple[Copy, ...]],
    ) -> None:
        self.trainer = trainer
        self.engine = engine
        self.streams = streams
        self.copies = copies
        self.fingerprint = plan_fingerprint(trainer, engine)
        self._pieces = [{p.name: p for p in stream} for stream in streams]
        self._links: dict[tuple[int, int], tuple[list[Piece], list[Copy]]] = {}
        self._link_bytes: dict[tuple[int, int], int] = {}

    @classmethod
    def build(cls, trainer: TrainerLayout, engine: EngineLayout) -> ShardPlan:
        """Map every byte each receiver needs to its one owner (see the module docstring).

        Raises:
            ValueError: the layouts disagree on a tensor's shape or dtype, or a needed
                byte has no owner or two (the message names the tensor, the box, the
                receiver and the ranks).
        """
        specs = {s.name: s for s in trainer.specs}
        for e in engine.specs:
            t = specs.get(e.name)
            if t is not None and (t.shape, t.dtype) != (e.shape, e.dtype):
                raise RequestError(
                    f"tensor `{e.name}`: the trainer layout has {t.describe()}, the engine "
                    f"layout {e.describe()} (build both from the same model's specs)"
                )
        # source -> (needed box, wire dtype, quantize) -> [(receiver, param, at)]
        needs: dict[str, dict[Wire, list[tuple[int, str, Box]]]] = {}
        for r, params in enumerate(engine.receivers):
            for p in params:
                for q in p.parts:
                    src = specs.get(q.source)
                    if src is None:
                        raise RequestError(
                            f"receiver {r} parameter `{p.name}` needs tensor `{q.source}`: "
                            "expected a tensor of the trainer layout, got an unknown name "
                            "(the engine layout names the trainer's tensors)"
                        )
                    key = (q.box, wire_dtype(src.dtype, p.dtype), p.quantize)
                    needs.setdefault(q.source, {}).setdefault(key, []).append((r, p.name, q.at))
        owners: dict[str, list[tuple[int, Box]]] = defaultdict(list)
        for s, boxes in enumerate(trainer.owned):
            for name, box in boxes.items():
                owners[name].append((s, box))
        streams: list[list[Piece]] = [[] for _ in range(trainer.ranks)]
        copies: dict[tuple[int, int], list[Copy]] = defaultdict(list)
        for t in trainer.specs:
            wanted = needs.get(t.name)
            if not wanted:
                continue
            held = owners.get(t.name, [])
            for (box, _, _), users in wanted.items():
                _check_owned(t, box, held, users[0])
            for s, owned in held:
                _plan_owner(t, owned, wanted, streams[s], copies, s)
        frozen = {k: tuple(v) for k, v in copies.items()}
        return cls(trainer, engine, tuple(tuple(x) for x in streams), frozen)

    # -- what it says -------------------------------------------------------------
    def senders_of(self, receiver: int) -> list[int]:
        """The trainer ranks receiver ``receiver`` takes bytes from."""
        return sorted(s for s, r in self.copies if r == receiver)

    def receivers_of(self, sender: int) -> list[int]:
        return sorted(r for s, r in self.copies if s == sender)

    def busiest_first(self, sender: int) -> list[int]:
        """Sender ``sender``'s receivers, the link that carries the most bytes first (ties
        by rank): a rank's links start and send in this order, since the update ends with
        its busiest link (2 -> 2 at 4.1 GB: 7.9-8.8 ms busiest first, 8.9-9.2 with a
        rank's 1.75 GB link started after its 0.3 GB one; ``python
        benchmarks/weights_sharded.py --device cuda --transport broadcast --point-to-point
        --senders 2 --receivers 2 --scale 2`` on four H200s)."""
        return sorted(self.receivers_of(sender), key=lambda r: (-self.link_bytes(sender, r), r))

    def piece(self, sender: int, name: str) -> Piece:
        return self._pieces[sender][name]

    def stream_specs(self, sender: int) -> list[TensorSpec]:
        """The names, shapes and dtypes sender ``sender`` pushes, in order."""
        return [p.spec() for p in self.streams[sender]]

    def stream_bytes(self, sender: int) -> int:
        """Bytes sender ``sender`` sends once per update (each needed byte once)."""
        return sum(p.nbytes for p in self.streams[sender])

    def link_bytes(self, sender: int, receiver: int) -> int:
        """Bytes receiver ``receiver`` takes from sender ``sender`` per update (what a
        point-to-point link carries)."""
        n = self._link_bytes.get((sender, receiver))
        if n is None:
            pieces = self._pieces[sender]
            n = self._link_bytes[(sender, receiver)] = sum(
                c.elements * pieces[c.piece].dtype.itemsize
                for c in self.copies.get((sender, receiver), ())
            )
        return n

    def link(self, sender: int, receiver: int) -> tuple[list[Piece], list[Copy]]:
        """A point-to-point link's own stream: exactly the boxes ``receiver`` needs of
        ``sender``'s (each once), and the copies that read them. Worked out once per link
        (a plan never changes; every update asks again)."""
        known = self._links.get((sender, receiver))
        if known is None:
            known = self._links[(sender, receiver)] = self._link(sender, receiver)
        return known

    def _link(self, sender: int, receiver: int) -> tuple[list[Piece], list[Copy]]:
        specs = {t.name: t for t in self.trainer.specs}
        pieces: dict[tuple[str, Box, torch.dtype, str | None], Piece] = {}
        copies = []
        for c in self.copies.get((sender, receiver), ()):
            p = self._pieces[sender][c.piece]
            if p.quantize == SCALES:
                continue  # with its values' copy, below
            box = shift(c.within, [a for a, _ in p.box])
            key = (p.source, box, p.dtype, p.quantize)
            q = pieces.get(key)
            if q is None:
                name = _piece_name(specs[p.source], box, p.dtype, p.quantize)
                q = pieces[key] = Piece(name, p.source, box, p.dtype, p.quantize)
                if q.quantize is not None:
                    pieces[(*key[:3], SCALES)] = q.scales()
            copies.append(Copy(q.name, relative(box, box), c.param, c.at))
            if q.quantize is not None:
                copies.append(_scale_copy(copies[-1], q.scales().name))
        return list(pieces.values()), copies

    def describe(self) -> str:
        sent = [self.stream_bytes(s) for s in range(self.trainer.ranks)]
        return (
            f"plan {self.fingerprint}: {self.trainer.ranks} senders -> "
            f"{len(self.engine.receivers)} receivers, {len(self.copies)} links, "
            f"{sum(sent)} bytes sent (busiest sender {max(sent)})"
        )


def plan_fingerprint(trainer: TrainerLayout, engine: EngineLayout) -> str:
    return hashlib.sha256(f"{trainer.fingerprint}/{engine.fingerprint}".encode()).hexdigest()[:16]


def _piece_name(t: TensorSpec, box: Box, dtype: torch.dtype, quantize: str | None) -> str:
    name = t.name if box == full_box(t.shape) else f"{t.name}{box_str(box)}"
    if quantize is not None:
        return f"{name}:{BLOCK_FP8}"
    return name if dtype == t.dtype else f"{name}:{dtype_name(dtype)}"


def _scale_copy(c: Copy, piece: str) -> Copy:
    """The copy of the scales of what block-FP8 copy ``c`` copies (both are whole blocks)."""
    return Copy(piece, block_box(c.within), scale_name(c.param), block_box(c.at))


def _check_owned(
    t: TensorSpec, box: Box, held: list[tuple[int, Box]], user: tuple[int, str, Box]
) -> None:
    """Every element of ``box`` has exactly one owner, or a ValueError naming who needs it."""
    hits = [(s, i) for s, o in held if (i := intersect(o, box) if box else o) is not None]
    got = sum(volume(i) for _, i in hits)
    want = volume(box)
    r, param, _ = user
    where = f"tensor `{t.name}` {box_str(box)}, needed by receiver {r} for `{param}`"
    if got < want:
        raise RequestError(
            f"{where}: expected every element owned by a trainer rank, got {want - got} of "
            f"{want} owned by none (the trainer layout must cover every tensor the engine needs)"
        )
    if got > want:
        ranks = [s for s, _ in hits]
        raise RequestError(
            f"{where}: expected each element owned by one trainer rank, got overlapping "
            f"boxes of ranks {ranks} (own a replicated tensor on one rank only)"
        )


def _plan_owner(
    t: TensorSpec,
    owned: Box,
    wanted: dict[Wire, list[tuple[int, str, Box]]],
    stream: list[Piece],
    copies: dict[tuple[int, int], list[Copy]],
    sender: int,
) -> None:
    """Sender ``sender``'s pieces of tensor ``t`` and the copies that read them."""
    mine: dict[tuple[torch.dtype, str | None], list[tuple[Box, Box, list[Any]]]] = {}
    for (box, dtype, quantize), users in wanted.items():
        inter = intersect(owned, box) if box else owned
        if inter is not None:
            mine.setdefault((dtype, quantize), []).append((inter, box, users))
    for (dtype, quantize), regions in mine.items():
        boxes = cover(r[0] for r in regions)
        if len(boxes) > 1 and sum(volume(b) for b in boxes) == volume(owned):
            boxes = [owned]  # they tile the shard: send it whole (one contiguous piece)
        pieces = [Piece(_piece_name(t, b, dtype, quantize), t.name, b, dtype, quantize)
                  for b in boxes]  # fmt: skip
        if quantize is None:
            stream.extend(pieces)
        else:  # each piece's values, then their scales
            _check_blocks(t, owned, pieces, regions, sender)
            stream.extend(x for p in pieces for x in (p, p.scales()))
        for inter, box, users in regions:
            for p in pieces:
                x = intersect(p.box, inter) if inter else p.box
                if x is None:
                    continue
                within = relative(x, p.box)
                off = relative(x, box)  # where x lies in the needed box
                for r, param, at in users:
                    lead = len(at) - len(box)
                    dest = at[:lead] + tuple(
                        (a0 + lo, a0 + hi) for (a0, _), (lo, hi) in zip(at[lead:], off, strict=True)
                    )
                    copies[(sender, r)].append(Copy(p.name, within, param, dest))
                    if quantize is not None:
                        copies[(sender, r)].append(
                            _scale_copy(copies[(sender, r)][-1], p.scales().name)
                        )


def _check_blocks(
    t: TensorSpec, owned: Box, pieces: list[Piece], regions: list[Any], sender: int
) -> None:
    """Every block-FP8 piece of ``sender`` is whole blocks, or a BlockFP8Error naming the
    rank whose shard cuts a block, and who keeps it in block FP8."""
    for p in pieces:
        if aligned(p.box, t.shape):
            continue
        r, param, _ = next(u for inter, _, users in regions for u in users
                           if intersect(inter, p.box) is not None)  # fmt: skip
        raise BlockFP8Error(
            f"tensor `{t.name}`: trainer rank {sender} owns {box_str(owned)} of it, which "
            f"cuts {BLOCK} x {BLOCK} blocks that receiver {r} keeps in block FP8 for "
            f"`{param}` (a block's scale is the amax of all its elements, and one rank holds "
            f"only part of it): shard the trainer so each rank's rows are whole blocks "
            f"(FSDP over ranks whose torch.chunk of dim 0 is a multiple of {BLOCK} rows), or "
            "keep this tensor unquantized"
        )
