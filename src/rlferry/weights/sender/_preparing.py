"""A sender's preparation of its pushes: the plan of the pushed layout (kept while the
layout stays), the device, the transport's buffers and group, the packer, and what each
receiver must attach before the stream."""

from __future__ import annotations

import itertools
from collections.abc import Callable, ItemsView, Iterable, Iterator
from typing import Any

import torch

from .._errors import WeightSyncError
from ..copies._pack import Packer
from ..planning._buckets import RAMP_BYTES, Plan, default_bucket_bytes
from ..planning._specs import TensorSpec, key_of, same_layout
from ..protocol._members import Member, Push
from ._parts import SenderParts

__all__ = ["Preparer"]

# re-iterable inputs streamed as they are (a bucket's tensors are taken without a walk)
_WHOLE = (list, tuple, ItemsView)

Kept = tuple[Plan | None, Any, Packer | None, torch.device | None]


class Preparer:
    """The plan of the last layout pushed and what was made for it: ``plan``, the pairs
    object it was last checked against (``planned_for``), the ``packer`` of its buckets
    into the transport's buffers, and the ``device`` the buffers live on."""

    def __init__(self, parts: SenderParts) -> None:
        self.parts = parts
        self.plan: Plan | None = None
        self.planned_for: Any = None  # the pairs object the plan was last checked against
        self.packer: Packer | None = None
        self.device: torch.device | None = parts.config.device
        self._bucket_cap: int | None = None  # the largest default bucket (see cap_buckets)

    def kept(self) -> Kept:
        """What a push that fails before any bucket moved leaves as it was (see restore)."""
        return self.plan, self.planned_for, self.packer, self.device

    def restore(self, kept: Kept) -> None:
        self.plan, self.planned_for, self.packer, self.device = kept

    def cap_buckets(self, cap: int) -> None:
        """Make the default bucket at most ``cap`` bytes (a multiple of 256): a
        :class:`ShardedSender` shares its rank's buffer budget among its links. A cap
        below the current plan's buckets takes effect at the next push (planned anew)."""
        self._bucket_cap = cap
        if self.plan is not None and self.plan.bucket_bytes > cap:
            self.plan = None

    def fast(
        self, plan: Plan, seq: int, version: int
    ) -> Callable[[list[Member]], Push | None] | None:
        """For the hub, run on the wire loop once the members are known: this push, if they
        need no setup (they hold ``plan`` and the broadcast group is theirs), else None.
        Only a collective transport whose packer is ready for ``plan`` takes this path (one
        hop less than begin, setup, start): None when it cannot."""
        coll, packer = self.parts.collective, self.packer
        if coll is None or packer is None or packer.plan is not plan:
            return None
        if packer.generation != self.parts.transport.generation:
            return None

        def fast(members: list[Member]) -> Push | None:
            if any(m.plan != plan.fingerprint or m.verify for m in members):
                return None
            if not coll.has_group([m.key for m in members]):
                return None
            return Push(seq, version, None, plan.fingerprint, members, {}, True, False)

        return fast

    def layout(
        self, named: Iterable[Any], layout: Iterable[tuple[str, Any]] | None
    ) -> tuple[Iterable[Any], Plan, bool]:
        """The data to stream, its plan, and whether each tensor must still be checked."""
        one_shot = isinstance(named, Iterator)
        if layout is None and one_shot and self.plan is None:
            named = list(named)  # a first push from a generator: it is read whole for its layout
            one_shot = False
        it = iter(named)
        first = next(it, None)
        if first is None:
            raise WeightSyncError("push: expected at least one named tensor, got none")
        data = named if isinstance(named, _WHOLE) else itertools.chain([first], it)
        if self.device is None:
            t = first[1]
            self.device = t.device if isinstance(t, torch.Tensor) else torch.device("cpu")
        source = layout if layout is not None else named
        if layout is None and one_shot:
            assert self.plan is not None
            return data, self.plan, True
        self.planned_for = named if layout is None and not one_shot else None
        if self.plan is None or not same_layout(source, self.plan.specs):
            specs = [TensorSpec(n, tuple(int(d) for d in s), dt) for n, s, dt in key_of(source)]
            largest = max(s.nbytes for s in specs)
            config = self.parts.config
            bucket = config.bucket_bytes or default_bucket_bytes(self.device, largest)
            if not config.bucket_bytes and self._bucket_cap is not None:
                bucket = min(bucket, self._bucket_cap)
            nccl = self.parts.collective is not None and self.device.type == "cuda"
            self.plan = Plan.build(specs, bucket, RAMP_BYTES if nccl else 0)
            self.packer = None
        return data, self.plan, layout is not None

    def setups(
        self, members: list[Member], plan: Plan, timeout: float, every: bool = False
    ) -> dict[bytes, Any]:
        """Prepare the transport for ``plan``; the descriptor for each member that must attach
        (``every``: each member, its Setup carrying what this push alone says)."""
        parts = self.parts
        tr, mail, coll = parts.transport, parts.mailbox, parts.collective
        assert self.device is not None
        group = None
        if coll is not None:
            keys = [m.key for m in members]
            group = coll.group_for(keys, timeout, self.device)
        tr.prepare(plan.buffer_bytes, self.device)
        packs = mail is None or not mail.direct
        if packs and (self.packer is None or self.packer.generation != tr.generation):
            self.packer = Packer(plan, tr, self.device, grouped=parts.config.grouped_pack)
        out = {}
        for m in members:
            if coll is not None:
                if group is not None or m.plan != plan.fingerprint or every:
                    base = group[m.key] if group is not None else coll.current(m.key)
                    out[m.key] = {**base, "generation": tr.generation}
            elif m.plan != plan.fingerprint or m.generation != tr.generation or every:
                assert mail is not None
                out[m.key] = {**mail.descriptor(), "generation": tr.generation}
        if out:
            parts.counts.plans += 1
        return out
