"""Packing: pushed tensors into bucket buffers (sender), bucket views out to ``load`` (receiver).

Both sides precompute, once per plan and set of buffers, the views of every
bucket (a typed view per whole tensor, a byte view per piece of a split one),
so a push costs the copies and not the building of thousands of views.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator
from typing import Any

import torch

from .._errors import WeightSyncError
from ..planning._buckets import Plan
from ..planning._specs import iterate_checked
from ..transports._base import BucketBuffers, strided_view
from ._copy import GroupedCopy, triton_available

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


class Packer:
    """The sender's precomputed destination views, per bucket.

    ``grouped``: a bucket whose tensors come again at the same addresses is packed
    with one grouped copy (CUDA: one Triton launch; CPU: one bulk host copy);
    False: always one ``_foreach_copy_`` (per tensor).
    """

    def __init__(
        self, plan: Plan, transport: BucketBuffers, device: torch.device, *, grouped: bool = True
    ) -> None:
        self.generation = transport.generation
        self.plan = plan
        split = plan.split()
        self._whole: list[tuple[list[torch.Tensor], list[int]]] = []
        self._parts: list[list[tuple[torch.Tensor, int, int, int]]] = []
        for k, chunks in enumerate(plan.by_bucket()):
            buf = transport.buffer(k % 2)
            dsts, idx, parts = [], [], []
            for c in chunks:
                region = buf[c.offset : c.offset + c.length]
                if c.tensor in split or c.length < plan.specs[c.tensor].nbytes:
                    parts.append((region, c.tensor, c.start, c.length))
                else:
                    spec = plan.specs[c.tensor]
                    dsts.append(region.view(spec.dtype).view(spec.shape))
                    idx.append(c.tensor)
            self._whole.append((dsts, idx))
            self._parts.append(parts)
        self._grouped = grouped and (
            device.type == "cpu" or (device.type == "cuda" and triton_available())
        )
        self._programs = COLLECTIVE_PROGRAMS if transport.collective else None
        self._copies: list[GroupedCopy | None] = [None] * plan.buckets
        # by bucket: where its tensors sat on the last push (address, strides)
        self._ptrs: list[list[tuple[int, tuple[int, ...]]] | None] = [None] * plan.buckets
        # set by the sender for each push: the same tensors as the last push (its caller
        # checked their memory), so a bucket's grouped copy is used without checking again
        self.same = False

    def forget(self, tensors: list[int]) -> None:
        """The buckets holding these tensors are packed from them anew (new memory): their
        grouped copies are built again once the tensors come again where they are now."""
        gone = set(tensors)
        for k in {c.bucket for c in self.plan.chunks if c.tensor in gone}:
            self._copies[k], self._ptrs[k] = None, None

    @torch.no_grad()
    def pack(self, k: int, tensors: list[Any]) -> None:
        dsts, idx = self._whole[k]
        copy = self._copies[k]
        if self.same and copy is not None:
            copy()
        elif dsts:
            self._pack_whole(k, dsts, [tensors[i] for i in idx])
        for region, i, start, length in self._parts[k]:
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
        if ptrs == self._ptrs[k]:
            if copy is None:
                # the pairs the kernel (CUDA) or the bulk copy (CPU) takes go by address;
                # the others by torch, from the views this copy was built with (the same
                # memory while the addresses match, as checked each push)
                copy = GroupedCopy(dsts, srcs, keep=False, programs=self._programs)
                self._copies[k] = copy
            copy()
            return
        self._ptrs[k], self._copies[k] = ptrs, None
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
    def direct(
        cls, plan: Plan, tensors: list[torch.Tensor], strides: list[list[int] | None]
    ) -> Unpacker:
        """Views of the sender's own tensors (``tensors[i]``: the bytes of tensor i, from
        its first; ``strides[i]``: its strides, None where contiguous), each handed to
        ``load`` with the bucket that holds its last chunk."""
        u = cls.__new__(cls)
        u.plan = plan
        u.loads = [BucketItems() for _ in range(plan.buckets)]
        u.parts = [[] for _ in range(plan.buckets)]
        u.bytes = [0] * plan.buckets
        last_bucket = {c.tensor: c.bucket for c in plan.chunks}
        if len(tensors) != len(plan.specs) or len(strides) != len(plan.specs):
            raise WeightSyncError(
                f"malformed setup: {len(tensors)} tensors for a plan of {len(plan.specs)}"
            )
        for i, spec in enumerate(plan.specs):
            view = strided_view(tensors[i], spec.name, spec.shape, spec.dtype, strides[i])
            k = last_bucket[i]
            u.loads[k].append((spec.name, view))
            u.bytes[k] += spec.nbytes
        return u

    @torch.no_grad()
    def stage(self, k: int) -> None:
        """Copy bucket ``k``'s pieces of split tensors into their staging tensors."""
        for dst, src in self.parts[k]:
            dst.copy_(src)
