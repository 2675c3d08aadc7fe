"""A sender's preparation of a push: the plan of its layout (kept while the layout stays),
the transport's buffers and group, the packer, what each receiver must attach, and how
the push starts (through the hub, on the receivers' start lines: see _line, or, over a
mailbox transport whose receivers committed the last push, by the pushing thread alone,
its tensors possibly written ahead). :class:`WeightSender` runs the push itself."""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from collections.abc import Callable, ItemsView, Iterable, Iterator
from typing import Any

import torch

from rlferry.wire._loop import WireLoop

from ._config import SenderConfig
from ._errors import WeightSyncError
from ._hub import Hub, Member, Push
from .copies._pack import Packer
from .planning._buckets import RAMP_BYTES, Plan, default_bucket_bytes
from .planning._specs import TensorSpec, key_of, same_layout
from .protocol._messages import Stream
from .transports._base import CollectiveSender, MailboxSender, SenderTransport

__all__ = ["PushPreparing"]

# re-iterable inputs streamed as they are (a bucket's tensors are taken without a walk)
_WHOLE = (list, tuple, ItemsView)


class PushPreparing:
    """The preparing half of :class:`WeightSender` (its state is made there)."""

    config: SenderConfig
    _lock: threading.Lock
    _transport: SenderTransport
    _mailbox: MailboxSender | None
    _collective: CollectiveSender | None
    _plan: Plan | None
    _planned_for: Any
    _packer: Packer | None
    _device: torch.device | None
    _bucket_cap: int | None
    _stats: dict[str, int]
    _hub: Hub
    _loop: WireLoop
    _committed: list[Member] | None
    _lining: Push | None
    _last_members: list[Member] | None
    _direct_of: tuple[Any, list[torch.Tensor]] | None
    _here_last: bool
    _ahead: tuple[list[Member], list[torch.Tensor]] | None

    def _cap_buckets(self, cap: int) -> None:
        """Make the default bucket at most ``cap`` bytes (a multiple of 256): a
        :class:`ShardedSender` shares its rank's buffer budget among its links. A cap
        below the current plan's buckets takes effect at the next push (planned anew)."""
        with self._lock:
            self._bucket_cap = cap
            if self._plan is not None and self._plan.bucket_bytes > cap:
                self._plan = None

    def _fast(
        self, plan: Plan, seq: int, version: int
    ) -> Callable[[list[Member]], Push | None] | None:
        """For the hub, run on the wire loop once the members are known: this push, if they
        need no setup (they hold ``plan`` and the broadcast group is theirs), else None.
        Only a collective transport whose packer is ready for ``plan`` takes this path (one
        hop less than begin, setup, start): None when it cannot."""
        coll, packer = self._collective, self._packer
        if coll is None or packer is None or packer.plan is not plan:
            return None
        if packer.generation != self._transport.generation:
            return None

        def fast(members: list[Member]) -> Push | None:
            if any(m.plan != plan.fingerprint or m.verify for m in members):
                return None
            if not coll.has_group([m.key for m in members]):
                return None
            return Push(seq, version, None, plan.fingerprint, members, {}, True, False)

        return fast

    def _begin(
        self, fast: Callable[[list[Member]], Push | None] | None, args: dict[str, Any],
        wait_for: int, deadline: float,
    ) -> tuple[concurrent.futures.Future[tuple[list[Member], Push | None]], bool]:  # fmt: skip
        """Start the push: on its members' lines if the last push ended on their word on
        the group and they are this one's too (True), else through the hub (False)."""
        last, self._committed = self._committed, None
        self._lining = None
        starter = self._hub.starter
        if fast is not None and last is not None and starter is not None:
            # this thread's snapshot of the hub's members: one that leaves from here on
            # fails the push as a receiver that dies mid-stream does
            now = list(self._hub.members.values())
            push = (
                fast(now)
                if len(now) == len(last) and all(a is b for a, b in zip(now, last, strict=True))
                and all(m.line and not m.gone for m in now)
                else None
            )  # fmt: skip
            if push is not None:
                push.direct = True
                self._lining = push  # its starts go from here on (see _abandon)
                msg = Stream(push.seq, push.version, False)
                first = starter.start(now[0].line, msg)
                if first is not None:  # none went: through the hub
                    self._lining = None
                else:  # the others' starts follow; one that cannot go fails it
                    sent = {m.name: starter.start(m.line, msg) for m in now[1:]}
                    push.unstarted = {n: why for n, why in sent.items() if why is not None}
                    return self._loop.submit(self._hub.begin_direct(push, deadline)), True
        return self._loop.submit(self._hub.begin(args, wait_for, deadline, fast)), False

    def _lines_started(self, push: Push) -> None:
        """The push started on its members' lines: raises if one left before it was
        registered or its start could not go (the caller aborts the push)."""
        failed = {m.name: m.error for m in push.members if m.error is not None}
        failed.update(
            {n: f"its start line refused the start ({why})" for n, why in push.unstarted.items()}
        )
        if failed:
            raise WeightSyncError(
                "the push started on the receivers' lines failed before its stream: "
                + "; ".join(f"receiver `{n}`: {why}" for n, why in failed.items())
            )
        self._stats["lines"] += 1

    def _layout(
        self, named: Iterable[Any], layout: Iterable[tuple[str, Any]] | None
    ) -> tuple[Iterable[Any], Plan, bool]:
        """The data to stream, its plan, and whether each tensor must still be checked."""
        one_shot = isinstance(named, Iterator)
        if layout is None and one_shot and self._plan is None:
            named = list(named)  # a first push from a generator: it is read whole for its layout
            one_shot = False
        it = iter(named)
        first = next(it, None)
        if first is None:
            raise WeightSyncError("push: expected at least one named tensor, got none")
        data = named if isinstance(named, _WHOLE) else itertools.chain([first], it)
        if self._device is None:
            t = first[1]
            self._device = t.device if isinstance(t, torch.Tensor) else torch.device("cpu")
        source = layout if layout is not None else named
        if layout is None and one_shot:
            assert self._plan is not None
            return data, self._plan, True
        self._planned_for = named if layout is None and not one_shot else None
        if self._plan is None or not same_layout(source, self._plan.specs):
            specs = [TensorSpec(n, tuple(int(d) for d in s), dt) for n, s, dt in key_of(source)]
            largest = max(s.nbytes for s in specs)
            bucket = self.config.bucket_bytes or default_bucket_bytes(self._device, largest)
            if not self.config.bucket_bytes and self._bucket_cap is not None:
                bucket = min(bucket, self._bucket_cap)
            ramp = RAMP_BYTES if self._collective is not None and self._device.type == "cuda" else 0
            self._plan = Plan.build(specs, bucket, ramp)
            self._packer = None
        return data, self._plan, layout is not None

    def _setups(self, members: list[Member], plan: Plan, timeout: float) -> dict[bytes, Any]:
        """Prepare the transport for ``plan``; the descriptor for each member that must attach."""
        tr, mail, coll = self._transport, self._mailbox, self._collective
        assert self._device is not None
        group = None
        if coll is not None:
            keys = [m.key for m in members]
            group = coll.group_for(keys, timeout, self._device)
        tr.prepare(plan.buffer_bytes, self._device)
        packs = mail is None or not mail.direct
        if packs and (self._packer is None or self._packer.generation != tr.generation):
            self._packer = Packer(plan, tr, self._device, grouped=self.config.grouped_pack)
        out = {}
        for m in members:
            if coll is not None:
                if group is not None or m.plan != plan.fingerprint:
                    base = group[m.key] if group is not None else coll.current(m.key)
                    out[m.key] = {**base, "generation": tr.generation}
            elif m.plan != plan.fingerprint or m.generation != tr.generation:
                assert mail is not None
                out[m.key] = {**mail.descriptor(), "generation": tr.generation}
        if out:
            self._stats["plans"] += 1
        return out

    def _lean(self, last: list[Member] | None) -> list[Member] | None:
        """The members of a push this thread may start alone, without the wire loop's hops
        (a begin that picks them, a start that tells them): over a mailbox transport whose
        receivers read the pushed tensors in place or have them written into theirs, when
        every receiver of the last push (``last``: all committed it) is still the hub's
        every member, holding the plan and buffers. On four H200s the hops put a 2 -> 2
        update's first write 1.2 ms into the push."""
        mail, plan = self._mailbox, self._plan
        if mail is None or not mail.direct or plan is None or last is None:
            return None
        now = list(self._hub.members.values())  # this thread's snapshot (see _begin)
        gen = self._transport.generation
        if len(now) != len(last) or not all(a is b for a, b in zip(now, last, strict=True)):
            return None
        # each asks for work, or will once its acknowledgement of the last push (which
        # ended on its word on the commit line) reaches the hub: the hub answers it with
        # this push's buckets then, whichever of the two it hears first
        if all(not m.gone and m.plan == plan.fingerprint and m.generation == gen
               and not m.verify for m in now):  # fmt: skip
            return now
        return None

    def _kept_direct(self, named: Any, same: bool, guard: Any) -> list[torch.Tensor] | None:
        """The tensors of the last push, read in place again: the caller pushes the very list
        it pushed last, its tensors checked to lie where they lay (``same``); else None."""
        kept = self._direct_of
        if kept is None or not same or guard is not None or kept[0] is not named:
            return None
        return kept[1] if named is self._planned_for else None

    def _write_ahead(self) -> None:
        """Before a push whose caller is about to check that its tensors lie where the last
        push's lay (a :class:`ShardedSender` on GPUs): if the last push went the
        :meth:`_lean` way with them too, make them ready now (cuda_ipc: the trainer's GPU
        starts writing into the receivers), and the push that follows, its tensors found
        in place, announces them. Found elsewhere, that push goes the usual way and writes
        them again: the bytes written ahead came from the kept views, whose memory they
        keep alive (never freed memory), and no receiver commits before the push's own
        announcement. On four H200s the checks took 0.3 ms of a 4.1 GB update's start."""
        with self._lock:
            kept = self._direct_of
            members = self._lean(self._last_members) if self._here_last else None
            if members is None or kept is None:
                return
            assert self._mailbox is not None
            self._mailbox.ready(kept[1], [m.key for m in members])
            self._ahead = (members, kept[1])

    def _forget_ahead(self) -> None:
        """The push after :meth:`_write_ahead` did not run (its caller failed first)."""
        self._ahead = None
