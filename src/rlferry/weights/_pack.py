"""Packing: pushed tensors into bucket buffers (sender), bucket views out to ``load`` (receiver).

Both sides precompute, once per plan and set of buffers, the views of every
bucket (a typed view per whole tensor, a byte view per piece of a split one),
so a push costs the copies and not the building of thousands of views.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator
from typing import Any

import torch

from ._copy import GroupedCopy, triton_available
from ._errors import WeightSyncError
from ._plan import Chunk, Plan, iterate_checked
from .transports._base import BucketBuffers

__all__ = ["BucketItems", "Packer", "Unpacker", "bucketed"]

COLLECTIVE_PROGRAMS = 64  # a pack beside NCCL's broadcast uses at most this many programs


class BucketItems(list[tuple[str, torch.Tensor]]):
    """What ``load`` gets for one bucket: a list, the same object every push while the
    plan and buffers stay the same (so a loader may cache per bucket, see ParamLoader)."""

    __slots__ = ("__weakref__",)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def bucketed(plan: Plan, named: Iterable[Any], checked: bool) -> Iterator[tuple[int, list[Any]]]:
    """``(k, tensors)`` for each bucket as soon as its last tensor came; ``tensors`` is
    indexed by tensor number, and a tensor is dropped once its last bucket is yielded."""
    if not checked and isinstance(named, (list, tuple, ItemsView)):  # all here: no walk
        if len(named) != len(plan.specs):
            raise WeightSyncError(
                f"the push gave {len(named)} tensors, its layout has {len(plan.specs)}"
            )
        tensors = [t for _, t in named]
        for k in range(plan.buckets):
            yield k, tensors
        return
    _, last_of, done = plan.order
    store: list[Any] = [None] * len(plan.specs)
    k, n = 0, plan.buckets
    pairs = iterate_checked(plan, named) if checked else _indexed(plan, named)
    for i, t in pairs:
        store[i] = t
        while k < n and last_of[k] <= i:
            yield k, store
            for j in done[k]:
                store[j] = None
            k += 1


def _indexed(plan: Plan, named: Iterable[Any]) -> Iterator[tuple[int, torch.Tensor]]:
    n = len(plan.specs)
    i = -1
    for i, (_, t) in enumerate(named):
        if i >= n:
            raise WeightSyncError(f"the push yielded more tensors than the {n} of its layout")
        yield i, t
    if i + 1 != n:
        raise WeightSyncError(f"the push yielded {i + 1} tensors, its layout has {n}")


class _Views:
    """Where a bucket's chunks are packed: whole tensors (``dsts``, typed views of the
    buffer, of pushed tensors ``idx``) and parts of split ones (``parts``: region, tensor,
    start, length)."""

    __slots__ = ("dsts", "idx", "parts")

    def __init__(self) -> None:
        self.dsts: list[torch.Tensor] = []
        self.idx: list[int] = []
        self.parts: list[tuple[torch.Tensor, int, int, int]] = []


class Packer:
    """The sender's precomputed destination views, per bucket.

    ``grouped``: a bucket whose tensors come again at the same addresses is packed
    with one grouped copy (CUDA: one Triton launch; CPU: one bulk host copy);
    False: always one ``_foreach_copy_`` (per tensor).

    ``direct`` (set by the sender for each push; a collective transport): the bucket's
    collectives are ``plan.ops``; a chunk that has one of its own is sent from the pushed
    tensor when that is contiguous on the buffers' device (nothing packed), the others
    are packed. ``sources[k]``: what each of bucket ``k``'s collectives sends.
    """

    def __init__(
        self, plan: Plan, transport: BucketBuffers, device: torch.device, *, grouped: bool = True
    ) -> None:
        self.generation = transport.generation
        self.plan = plan
        split = plan.split()
        self._whole = [_Views() for _ in range(plan.buckets)]  # every chunk: packed pushes
        self._runs = [_Views() for _ in range(plan.buckets)]  # direct pushes: the runs' chunks
        # direct: a bucket's lone chunks (a collective each): (its position in the
        # bucket's ops, the chunk, its region as the whole tensor, or None for a part)
        self._lone: list[list[tuple[int, Chunk, torch.Tensor | None]]] = []
        self._regions: list[list[torch.Tensor]] = []  # direct: each op's bytes of the buffer
        ops = plan.ops
        for k in range(plan.buckets):
            buf = transport.buffer(k % 2)
            self._regions.append([buf[o.start : o.end] for o in ops[k]])
            self._lone.append([])
        lone_at = {o.chunk: (k, pos) for k in range(plan.buckets) for pos, o in
                   enumerate(ops[k]) if o.chunk >= 0}  # fmt: skip
        for j, c in enumerate(plan.chunks):
            region = transport.buffer(c.bucket % 2)[c.offset : c.offset + c.length]
            spec = plan.specs[c.tensor]
            whole = None
            if c.tensor not in split and c.length == spec.nbytes:
                whole = region.view(spec.dtype).view(spec.shape)
            views = [self._whole[c.bucket]]
            if j in lone_at:
                k, pos = lone_at[j]
                self._lone[k].append((pos, c, whole))
            else:
                views.append(self._runs[c.bucket])
            for v in views:
                if whole is not None:
                    v.dsts.append(whole)
                    v.idx.append(c.tensor)
                else:
                    v.parts.append((region, c.tensor, c.start, c.length))
        self._grouped = grouped and (
            device.type == "cpu" or (device.type == "cuda" and triton_available())
        )
        self._programs = COLLECTIVE_PROGRAMS if transport.collective else None
        self._copies: list[GroupedCopy | None] = [None] * plan.buckets
        # by bucket: where its tensors sat on the last push (address, strides)
        self._ptrs: list[list[tuple[int, tuple[int, ...]]] | None] = [None] * plan.buckets
        self._copy_direct = [False] * plan.buckets  # the copy is a direct push's (runs only)
        # set by the sender for each push: the same tensors as the last push (its caller
        # checked their memory), so a bucket's grouped copy is used without checking again
        self.same = False
        # set by the sender for each push: a direct stream (a collective transport)
        self.direct = False
        self.sources: list[list[torch.Tensor]] = [[] for _ in range(plan.buckets)]
        self._device = device

    @torch.no_grad()
    def pack(self, k: int, tensors: list[Any]) -> None:
        if self.direct:
            self._pack_direct(k, tensors)
            return
        v = self._whole[k]
        copy = self._copies[k]
        if self.same and copy is not None and not self._copy_direct[k]:
            copy()
        elif v.dsts:
            self._pack_whole(k, v.dsts, [tensors[i] for i in v.idx])
        for region, i, start, length in v.parts:
            region.copy_(_bytes_of(tensors[i])[start : start + length])

    def _pack_direct(self, k: int, tensors: list[Any]) -> None:
        """Bucket ``k`` of a direct stream: each lone chunk's collective sends the pushed
        tensor's own bytes when it can (contiguous, on the buffers' device), else its packed
        region; every other chunk is packed (one grouped copy, as ``pack``)."""
        runs = self._runs[k]
        dsts, srcs = list(runs.dsts), [tensors[i] for i in runs.idx]
        parts = list(runs.parts)
        sources = list(self._regions[k])
        for pos, c, whole in self._lone[k]:
            t = tensors[c.tensor]
            if t.is_contiguous() and t.device == self._device:
                sources[pos] = t.reshape(-1).view(torch.uint8)[c.start : c.start + c.length]
            elif whole is not None:
                dsts.append(whole)
                srcs.append(t)
            else:
                parts.append((sources[pos], c.tensor, c.start, c.length))
        self.sources[k] = sources
        if dsts:
            self._pack_whole(k, dsts, srcs)
        for region, i, start, length in parts:
            region.copy_(_bytes_of(tensors[i])[start : start + length])

    def _pack_whole(self, k: int, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """One grouped copy when the bucket's tensors sit where they sat on the last push
        (a state dict pushed again: the table is built on the second push and reused while
        they stay; strided views, a sharded push's pieces, included), else one
        ``_foreach_copy_``."""
        if not self._grouped:
            torch._foreach_copy_(dsts, srcs)
            return
        ptrs = [(t.data_ptr(), t.stride()) for t in srcs]
        copy = self._copies[k]
        if ptrs == self._ptrs[k] and self._copy_direct[k] == self.direct:
            if copy is None:
                # the pairs the kernel (CUDA) or the bulk copy (CPU) takes go by address;
                # the others by torch, from the views this copy was built with (the same
                # memory while the addresses match, as checked each push)
                copy = GroupedCopy(dsts, srcs, keep=False, programs=self._programs)
                self._copies[k] = copy
            copy()
            return
        self._ptrs[k], self._copies[k], self._copy_direct[k] = ptrs, None, self.direct
        torch._foreach_copy_(dsts, srcs)


class Unpacker:
    """The receiver's precomputed views, per bucket: what ``load`` gets.

    Whole tensors are views of the bucket buffer. A split tensor's pieces are
    copied into a staging tensor (made once per plan), handed to ``load`` with
    the bucket that completes it.
    """

    def __init__(self, plan: Plan, buffers: list[torch.Tensor]) -> None:
        self.plan = plan
        split = plan.split()
        device = buffers[0].device
        staging = {
            i: torch.empty(plan.specs[i].nbytes, dtype=torch.uint8, device=device) for i in split
        }
        last_bucket = {c.tensor: c.bucket for c in plan.chunks}
        self.loads: list[BucketItems] = []
        self.parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.bytes: list[int] = []
        for k, chunks in enumerate(plan.by_bucket()):
            buf = buffers[k % 2]
            items, parts, nbytes = BucketItems(), [], 0
            for c in chunks:
                spec = plan.specs[c.tensor]
                region = buf[c.offset : c.offset + c.length]
                if c.tensor in split:
                    parts.append((staging[c.tensor][c.start : c.start + c.length], region))
                    if last_bucket[c.tensor] == k:
                        whole = staging[c.tensor].view(spec.dtype).view(spec.shape)
                        items.append((spec.name, whole))
                        nbytes += spec.nbytes
                else:
                    items.append((spec.name, region.view(spec.dtype).view(spec.shape)))
                    nbytes += spec.nbytes
            self.loads.append(items)
            self.parts.append(parts)
            self.bytes.append(nbytes)

    @classmethod
    def direct(cls, plan: Plan, tensors: list[torch.Tensor]) -> Unpacker:
        """Views of the sender's own tensors (``tensors[i]``: the bytes of tensor i, from
        its first), each handed to ``load`` with the bucket that holds its last chunk."""
        u = cls.__new__(cls)
        u.plan = plan
        u.loads = [BucketItems() for _ in range(plan.buckets)]
        u.parts = [[] for _ in range(plan.buckets)]
        u.bytes = [0] * plan.buckets
        last_bucket = {c.tensor: c.bucket for c in plan.chunks}
        for i, spec in enumerate(plan.specs):
            view = tensors[i][: spec.nbytes].view(spec.dtype).view(spec.shape)
            k = last_bucket[i]
            u.loads[k].append((spec.name, view))
            u.bytes[k] += spec.nbytes
        return u

    @torch.no_grad()
    def stage(self, k: int) -> None:
        """Copy bucket ``k``'s pieces of split tensors into their staging tensors."""
        for dst, src in self.parts[k]:
            dst.copy_(src)
