"""A sharded push's tensors: read once, checked against the last push, cut into pieces.

A :class:`ShardedSender` keeps the views (pieces) it cut from a push's tensors and
pushes them again while the tensors lie where they lay: same names and shapes (read
before the links start), same addresses, strides and dtypes. A model of many tensors
pays for each such read at every push (18,867 for Qwen3-30B-A3B: milliseconds a pass).
Over ``broadcast``, where a push sends bucket after bucket, the addresses are read one
bucket at a time instead (:class:`Guard`): just before a bucket is packed, for the tensors
its pieces are cut from, while the buckets before it move; a tensor found elsewhere has
its pieces cut again before any of them is packed.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..planning._shard_plan import ShardPlan
from ..planning._specs import where_of
from ._cuts import Cuts

__all__ = ["Guard", "Ready", "local_tensors"]

_shape_of, _dtype_of = operator.attrgetter("shape"), operator.attrgetter("dtype")


class Ready:
    """A push's tensors: this rank's local shards and their names and shapes, read at
    once; where they lie, read once for every link (on the first link's call: once every
    link started, when the push can go early) or bucket by bucket (``lazy``); each link's
    pieces (the views kept from the last push while the tensors lie where they did)."""

    def __init__(self, cuts: Cuts, plan: ShardPlan, named: Any) -> None:
        self.cuts, self.plan = cuts, plan
        self.local, self.plain = local_tensors(named)
        self.tensors = list(self.local.values())
        self.shapes = (list(self.local), list(map(_shape_of, self.tensors)) if self.plain
                       else [getattr(t, "shape", None) for t in self.tensors])  # fmt: skip
        self.where: tuple[list[Any], ...] = ()
        self.lazy = False  # set by the sender: addresses read by each link's Guard
        self.changed: set[int] = set()  # lazy: the tensors found elsewhere (by position)
        self.quantized: dict[Any, Any] = {}  # block FP8, by source and region: once a push
        self._done = False

    def __call__(self) -> None:
        if self._done:
            return
        c = self.cuts
        self.where = where = where_of(self.tensors, self.plain)
        if self.plan is not c.plan or where != c.where or self.shapes != c.shapes:
            c.views = {}  # other tensors (or a new plan): the views are cut again
        c.where, c.shapes = where, self.shapes
        first = next(iter(self.local.values()), None)
        c.on_gpu = isinstance(first, torch.Tensor) and first.is_cuda
        self._done = True

    def keep_where(self) -> None:
        """Lazy, once the push went: where the tensors its guards found moved lie now,
        for the next push's checks."""
        w = self.cuts.where
        assert w is not None and len(w) == 3
        for p in self.changed:
            t = self.tensors[p]
            w[0][p], w[1][p], w[2][p] = t.data_ptr(), t.stride(), t.dtype

    def pieces(self, r: int) -> tuple[list[tuple[str, torch.Tensor]], bool, Guard | None]:
        """Link ``r``'s pieces, whether they are the list it pushed last (the same
        tensors: their checks are skipped) and, lazy, the guard that checks them."""
        kept = self.cuts.views.get(r)
        if self.lazy and kept is not None:
            return kept, True, Guard(self, r, kept)
        self()
        kept = self.cuts.views.get(r)
        pieces = self.cuts.pieces(self.plan, r, self.local, self.quantized)
        return pieces, pieces is kept, None


class Guard:
    """Link ``r``'s check of a lazy push, called by its sender with the indices of a
    bucket's pieces before it packs them: the tensors they are cut from are read (a list
    at a time) against where they lay on the last push, and the pieces of a tensor found
    elsewhere are cut again, in the kept list and in the bucket's; returns the indices of
    the pieces replaced (their buckets' grouped copies must be built again). Where the
    moved tensors lie now is kept once the push went (:meth:`ShardedSender.push`)."""

    def __init__(self, ready: Ready, r: int, pieces: list[tuple[str, torch.Tensor]]) -> None:
        self.ready, self.pieces = ready, pieces
        self.source, self.of_source, self.buckets = ready.cuts.sources(r, ready.shapes[0])
        w = ready.cuts.where
        assert w is not None and len(w) == 3
        self.where = w
        self.done: set[int] = set()

    def __call__(self, indices: list[int], tensors: list[Any]) -> list[int]:
        # a bucket's sources, kept by its list of indices (the same object while the
        # link's plan is: held here, so its id is not reused)
        kept = self.buckets.get(id(indices))
        if kept is None or kept[0] is not indices:
            kept = self.buckets[id(indices)] = (
                indices,
                list(set(map(self.source.__getitem__, indices))),
            )
        ps = kept[1]
        ts = list(map(self.ready.tensors.__getitem__, ps))
        w0, w1, w2 = self.where
        if (
            list(map(torch.Tensor.data_ptr, ts)) == list(map(w0.__getitem__, ps))
            and list(map(torch.Tensor.stride, ts)) == list(map(w1.__getitem__, ps))
            and list(map(_dtype_of, ts)) == list(map(w2.__getitem__, ps))
        ):
            return []
        out = []
        for p, t in zip(ps, ts, strict=True):
            if p in self.done or (t.data_ptr(), t.stride(), t.dtype) == (w0[p], w1[p], w2[p]):
                continue
            self.done.add(p)
            self.ready.changed.add(p)
            for i, at in self.of_source[p]:
                view = t.detach() if at is None else t[at]
                self.pieces[i] = (self.pieces[i][0], view)
                tensors[i] = view
                out.append(i)
        return out


def local_tensors(
    named: Mapping[str, Any] | Iterable[tuple[str, Any]],
) -> tuple[dict[str, Any], bool]:
    """This rank's tensors by name (a DTensor's local shard, a plain tensor as it is), and
    whether all are tensors. A dict of plain tensors (a ``state_dict()``) is taken as it
    is: each pass over 18,867 tensors costs a millisecond or more."""
    if not isinstance(named, dict):
        named = dict(named.items() if isinstance(named, Mapping) else named)
    types = set(map(type, named.values()))
    if types <= {torch.Tensor, torch.nn.Parameter}:
        return named, True
    local = {n: t.to_local() if hasattr(t, "to_local") else t for n, t in named.items()}
    return local, all(issubclass(c, torch.Tensor) for c in set(map(type, local.values())))
