"""One engine rank's links, as it sees them: each trainer rank it hears from, its
receiver, where it stands, and the copies of its pieces into the rank's own tensors."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from rlferry.errors import RequestError

from .._errors import BlockFP8Error
from ..copies._copy import GroupedCopy
from ..planning._blocks import scale_name
from ..planning._boxes import extents, slices
from ..planning._shard_plan import ShardPlan

if TYPE_CHECKING:
    from ..receiver._receiver import WeightReceiver

__all__ = ["Copies", "Link", "Op", "copies_of", "ops_of", "targets_for"]

Op = tuple[tuple[slice, ...], torch.Tensor, bool]  # piece region, destination view, reshape
Ops = dict[str, list[Op]]  # by piece name


class Copies:
    """A bucket's copies into this rank's tensors, one :class:`GroupedCopy` (one launch on
    CUDA, one bulk copy on the CPU), which works on the tensors' addresses: ``moved`` says
    whether a destination's changed since (its storage moved into shared memory by a
    zero-copy push of it, say), and then it must be built again. The sources are views of
    the receiver's buffers, fixed while the bucket's list is the same object (the list
    this is kept by). ``views``: every source is a view of the bucket (else a reshape
    copied one: good for this push only)."""

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], views: bool) -> None:
        self.copy = GroupedCopy(dsts, srcs)
        self.dsts = dsts
        self.addresses = list(map(torch.Tensor.data_ptr, dsts))
        self.views = views

    def moved(self) -> bool:  # read at C speed: 18,867 pieces a push in MoE models
        return list(map(torch.Tensor.data_ptr, self.dsts)) != self.addresses


class Link:
    """One trainer rank, as an engine rank sees it: its receiver and where it stands."""

    def __init__(self, sender: int, address: str) -> None:
        self.sender = sender
        self.address = address
        self.receiver: WeightReceiver | None = None
        self.version: int | None = None
        self.failure: tuple[int | None, str, bool] | None = None  # (version, reason, final)
        # by rlferry's list of a bucket's views: its copies into this rank's tensors, one
        # GroupedCopy (one launch on CUDA), kept while the list is handed again
        self.copies: dict[int, Copies] = {}

    def load(self, ops: Ops, items: list[tuple[str, torch.Tensor]]) -> None:
        """Copy this rank's pieces of a bucket (``items``) into its tensors (``ops``)."""
        kept = self.copies.get(id(items))
        if kept is not None and kept.moved():
            kept = None  # a tensor's storage moved (share_memory_ does): built again
        if kept is None:
            kept = copies_of(ops, items)
            if kept.views:  # its sources are views of the bucket: kept for the next push
                try:
                    weakref.finalize(items, self.copies.pop, id(items), None)
                    self.copies[id(items)] = kept
                except TypeError:  # not rlferry's list (a plain list cannot be watched)
                    pass
        kept.copy()


def ops_of(
    plan: ShardPlan, rank: int, params: Mapping[str, torch.Tensor], point_to_point: bool
) -> dict[int, Ops]:
    """By trainer rank, the copies of its pieces into engine rank ``rank``'s tensors
    (``params``, checked against the rank's specs in the engine layout)."""
    want = plan.engine.param_specs(rank)
    block = {n: p.name for p in plan.engine.receivers[rank] if p.quantize is not None
             for n in (p.name, scale_name(p.name))}  # fmt: skip
    for n, spec in want.items():
        t = params.get(n)
        if t is None or tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            got = "no such tensor" if t is None else f"shape {list(t.shape)} {t.dtype}"
            if n in block:
                raise BlockFP8Error(
                    f"ShardedReceiver.params[{n!r}]: expected {spec.describe()}, got {got}: "
                    f"the engine layout keeps `{block[n]}` in block FP8 (float8_e4m3fn values "
                    f"and `{scale_name(block[n])}`, float32 scales), engine rank {rank} does "
                    "not (give it both tensors, or an engine layout without block FP8)"
                )
            raise RequestError(
                f"ShardedReceiver.params[{n!r}]: expected {spec.describe()} (engine rank "
                f"{rank} of the engine layout), got {got} (give this rank's tensors, "
                "made from EngineLayout.param_specs)"
            )
    ops: dict[int, Ops] = {}
    for s in plan.senders_of(rank):
        mine: Ops = {}
        copies = plan.link(s, rank)[1] if point_to_point else plan.copies[(s, rank)]
        for c in copies:
            dst = params[c.param][slices(c.at)]
            mine.setdefault(c.piece, []).append(
                (slices(c.within), dst, extents(c.within) != tuple(dst.shape))
            )
        ops[s] = mine
    return ops


def targets_for(ops: Ops, plan: Any) -> list[list[tuple[tuple[slice, ...], torch.Tensor]]] | None:
    """Where each tensor of a link's plan goes in this rank's tensors: the regions and
    views a cuda_ipc sender writes (see ``transports._cuda_shared``); None where a
    region cannot be written as it is (a view that reshaping would copy)."""
    out = []
    for spec in plan.specs:
        entry = []
        for region, dst, reshape in ops.get(spec.name, ()):
            if reshape:
                try:
                    dst = dst.view([s.stop - s.start for s in region])
                except RuntimeError:
                    return None
            entry.append((region, dst))
        out.append(entry)
    return out


def copies_of(ops: Ops, items: list[tuple[str, torch.Tensor]]) -> Copies:
    """This rank's copies of a bucket's pieces (pieces for others skipped)."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    views = True
    for name, t in items:
        for region, dst, reshape in ops.get(name, ()):
            src = t[region]
            if reshape:
                views &= src.is_contiguous()
                src = src.reshape(dst.shape)
            dsts.append(dst)
            srcs.append(src)
    # A full grid, even beside a collective (the next bucket arriving on NCCL's
    # high-priority stream): a 4.1 GB update of one rank to one takes 12.7-13.1 ms so,
    # 13.2-13.3 with the bounded grid the sender's packs take (``python
    # benchmarks/weights_sharded.py --device cuda --transport broadcast --senders 1
    # --receivers 1 --scale 2`` on two H200s).
    return Copies(dsts, srcs, views)
