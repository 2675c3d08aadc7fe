"""How one trainer rank's pushed tensors are cut into the pieces of each stream, and what
the last push left: the views cut from its tensors (pushed again while the same tensors
are pushed, as a state dict is) and where those tensors lay."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from .._errors import WeightSyncError
from ..copies import quantize_block_fp8
from ..planning._boxes import extents, relative, slices
from ..planning._shard_plan import SCALES, Piece, ShardPlan

__all__ = ["Cut", "Cuts"]


class Cut(NamedTuple):
    """A piece of a stream as cut from this rank's shard of ``source`` (of ``shape``):
    ``at`` its slices (None: the whole shard), sent as ``dtype`` under ``name``;
    ``quantize``: the piece's (block FP8: its values, or the scales that follow them)."""

    name: str
    source: str
    shape: tuple[int, ...]
    at: tuple[slice, ...] | None
    dtype: torch.dtype
    quantize: str | None = None


class Cuts:
    """Trainer rank ``rank``'s cuts, by stream (-1: the shared one; else an engine rank's
    link), for ``plan``; ``views``, by stream, the pieces cut from the last push's tensors
    (views of the same memory); ``where`` those tensors lay (address, strides, dtype; see
    ``planning._specs.where_of``) and their names and ``shapes`` (checked once a push);
    ``on_gpu``: the last push's tensors were on a GPU."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.plan: ShardPlan | None = None  # the plan the cuts below were made for
        self._cut_cache: dict[int, list[Cut]] = {}
        self._source_cache: dict[int, tuple[Any, ...]] = {}  # see sources
        self.views: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.where: tuple[list[Any], ...] | None = None
        self.shapes: tuple[list[Any], list[Any]] | None = None
        self.on_gpu = False

    def forget(self) -> None:
        """The views and where the tensors lay go: the next push cuts again."""
        self.views, self.where, self.shapes = {}, None, None

    def cuts(self, plan: ShardPlan, receiver: int) -> list[Cut]:
        """How to cut each piece of a stream (the shared one: ``receiver`` -1) from this
        rank's shards: worked out once per plan and stream, not per push."""
        if plan is not self.plan:  # a new plan (a layout changed): the old cuts go,
            self.plan, self._cut_cache = plan, {}  # and the views cut by them
            self.views = {}
        cuts = self._cut_cache.get(receiver)
        if cuts is None:
            owned = plan.trainer.owned[self.rank]
            pieces: Iterable[Piece] = (
                plan.streams[self.rank] if receiver < 0 else plan.link(self.rank, receiver)[0]
            )
            cuts = []
            for p in pieces:
                box = owned[p.source]
                at = None if p.box == box else slices(relative(p.box, box))
                cuts.append(Cut(p.name, p.source, extents(box), at, p.dtype, p.quantize))
            self._cut_cache[receiver] = cuts
        return cuts

    def sources(
        self, r: int, names: list[str]
    ) -> tuple[list[int], dict[int, list[tuple[int, Any]]], dict[int, Any]]:
        """For link ``r``'s pieces (in order): the position among the pushed tensors
        (``names``, in order) of each one's source, by source its pieces (index, cut
        slices), and a dict for the guards to keep each bucket's sources in; worked out
        once per plan, stream and order of names."""
        got = self._source_cache.get(r)
        if got is not None and got[0] is self.plan and got[1] == names:
            return got[2], got[3], got[4]
        at = {n: p for p, n in enumerate(names)}
        source: list[int] = []
        of_source: dict[int, list[tuple[int, Any]]] = {}
        assert self.plan is not None
        for i, c in enumerate(self.cuts(self.plan, r)):
            p = at[c.source]
            source.append(p)
            of_source.setdefault(p, []).append((i, c.at))
        buckets: dict[int, Any] = {}
        self._source_cache[r] = (self.plan, names, source, of_source, buckets)
        return source, of_source, buckets

    @torch.no_grad()
    def pieces(
        self,
        plan: ShardPlan,
        receiver: int,
        local: dict[str, torch.Tensor],
        quantized: dict[Any, Any] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Stream ``receiver``'s pieces of this rank's tensors (``local``, by name): the
        views cut from the last push's, while they are kept. A block-FP8 piece is quantized
        where its tensor lies, once a push for every link that takes the same region
        (``quantized``: the push's, by source and region)."""
        kept = self.views.get(receiver)
        if kept is not None:
            return kept  # the same tensors again (same memory and layout): the same views
        cuts = self.cuts(plan, receiver)
        out = []
        cast = False
        scales: torch.Tensor | None = None  # of the block-FP8 values just quantized
        for c in cuts:
            if c.quantize == SCALES:
                assert scales is not None
                out.append((c.name, scales))
                continue
            t = local.get(c.source)
            if t is None:
                raise WeightSyncError(
                    f"push: tensor `{c.source}`: expected it (trainer rank {self.rank} owns "
                    f"{list(c.shape)} of it and receivers need them), got no such name (push "
                    "this rank's tensors under the trainer layout's names)"
                )
            if tuple(t.shape) != c.shape:
                raise WeightSyncError(
                    f"push: tensor `{c.source}` on trainer rank {self.rank}: expected its local "
                    f"shard of shape {list(c.shape)}, got {list(t.shape)} (the trainer "
                    "layout does not describe this rank's tensors)"
                )
            v = t.detach() if c.at is None else t[c.at]
            if c.quantize is not None:  # block FP8: quantized where the shard lies
                region = None if c.at is None else tuple((a.start, a.stop) for a in c.at)
                key = (c.source, region)
                done = None if quantized is None else quantized.get(key)
                v, scales = done if done is not None else quantize_block_fp8(v)
                if quantized is not None:
                    quantized[key] = (v, scales)
            cast = cast or v.dtype != c.dtype or c.quantize is not None
            out.append((c.name, v.to(c.dtype) if v.dtype != c.dtype else v))
        if not cast:  # views only (a cast makes a new tensor each push): kept
            self.views[receiver] = out
        return out
