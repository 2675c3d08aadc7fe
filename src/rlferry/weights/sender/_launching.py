"""How a sender's push starts: through its hub (the wire loop picks the members and tells
them), on the members' start lines (the pushing thread tells them itself: see
``protocol._datagrams``), or, over a mailbox transport whose receivers committed the last
push, by the pushing thread alone, its tensors possibly written ahead. What the last push
left decides which: its members and how it ended."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch

from .._errors import WeightSyncError
from ..protocol._members import Member, Push
from ..protocol._messages import Stream
from ._parts import SenderParts
from ._preparing import Preparer

__all__ = ["Launcher"]

Ahead = tuple[list[Member], list[torch.Tensor]]


class Launcher:
    """A sender's ways to start a push, and what the last push left for the next."""

    def __init__(self, parts: SenderParts, preparer: Preparer) -> None:
        self.parts = parts
        self.preparer = preparer
        # the members of the last push, if it ended on their word on the group: the next
        # may start on their lines
        self.committed: list[Member] | None = None
        self.lining: Push | None = None  # a push whose starts go on its members' lines
        # the members of the last push over a mailbox transport, if each committed it, and
        # the list it pushed with the tensors it let receivers read in place (see lean)
        self._last_members: list[Member] | None = None
        self._direct_of: tuple[Any, list[torch.Tensor]] | None = None
        self._here_last = False  # the last push went that way (see write_ahead)
        self._ahead: Ahead | None = None  # its tensors, written ahead of the next push

    # -- what the last push left ------------------------------------------------------
    def take(self) -> tuple[list[Member] | None, Ahead | None]:
        """What the last push left for this one, each taken once: its members, if each
        committed it over a mailbox transport, and the tensors written ahead of this one."""
        last, ahead = self._last_members, self._ahead
        self._last_members = self._ahead = None
        self._here_last = False
        return last, ahead

    def ended(self, members: list[Member], *, on_group: bool, every: bool) -> None:
        """The push of ``members`` ended with no failure: ``on_group``, on their word on the
        group that they committed (the next may start on their lines); ``every``, each
        committed it over a mailbox transport (the next may start from this thread)."""
        if on_group:
            self.committed = members
        if every:
            self._last_members = members

    def keep_direct(self, named: Any, direct: list[torch.Tensor] | None) -> None:
        """The push of ``named`` let its receivers read ``direct`` in place (None: packed)."""
        self._direct_of = (named, direct) if direct is not None else None

    def started_here(self) -> None:
        """The push in progress (``lining``) was started by the pushing thread alone (see
        :meth:`lean`)."""
        self._here_last = True
        self.parts.counts.here += 1

    # -- through the hub, or on the members' lines --------------------------------------
    def begin(
        self, fast: Callable[[list[Member]], Push | None] | None, args: dict[str, Any],
        wait_for: int, deadline: float,
    ) -> tuple[concurrent.futures.Future[tuple[list[Member], Push | None]], bool]:  # fmt: skip
        """Start the push: on its members' lines if the last push ended on their word on
        the group and they are this one's too (True), else through the hub (False)."""
        parts = self.parts
        last, self.committed = self.committed, None
        self.lining = None
        starter = parts.hub.starter
        if fast is not None and last is not None and parts.collective is not None:
            # this thread's snapshot of the hub's members: one that leaves from here on
            # fails the push as a receiver that dies mid-stream does
            now = list(parts.hub.members.values())
            push = (
                fast(now)
                if len(now) == len(last) and all(a is b for a, b in zip(now, last, strict=True))
                and all(m.line and not m.gone for m in now)
                else None
            )  # fmt: skip
            if push is not None:
                push.direct = True
                self.lining = push  # its starts go from here on (see Finisher.abandon)
                msg = Stream(push.seq, push.version, False)
                first = starter.start(now[0].line, msg)
                if first is not None:  # none went: through the hub
                    self.lining = None
                else:  # the others' starts follow; one that cannot go fails it
                    sent = {m.name: starter.start(m.line, msg) for m in now[1:]}
                    push.unstarted = {n: why for n, why in sent.items() if why is not None}
                    return parts.loop.submit(parts.course.begin_direct(push, deadline)), True
        return parts.loop.submit(parts.course.begin(args, wait_for, deadline, fast)), False

    def lines_started(self, push: Push) -> None:
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
        self.parts.counts.lines += 1

    # -- by the pushing thread alone --------------------------------------------------
    def lean(self, last: list[Member] | None) -> list[Member] | None:
        """The members of a push this thread may start alone, without the wire loop's hops
        (a begin that picks them, a start that tells them): over a mailbox transport whose
        receivers read the pushed tensors in place or have them written into theirs, when
        every receiver of the last push (``last``: all committed it) is still the hub's
        every member, holding the plan and buffers. The hops put a 2 -> 2 update's first
        write 1.2 ms into the push (``python benchmarks/weights_sharded.py --device cuda
        --point-to-point --senders 2 --receivers 2 --scale 2 --transport cuda_ipc --gpus 4
        --trace DIR`` on four H200s)."""
        parts, plan = self.parts, self.preparer.plan
        mail = parts.mailbox
        if mail is None or not mail.direct or plan is None or last is None:
            return None
        now = list(parts.hub.members.values())  # this thread's snapshot (see begin)
        gen = parts.transport.generation
        if len(now) != len(last) or not all(a is b for a, b in zip(now, last, strict=True)):
            return None
        # each asks for work, or will once its acknowledgement of the last push (which
        # ended on its word on the commit line) reaches the hub: the hub answers it with
        # this push's buckets then, whichever of the two it hears first
        if all(not m.gone and m.plan == plan.fingerprint and m.generation == gen
               and not m.verify for m in now):  # fmt: skip
            return now
        return None

    def kept_direct(self, named: Any, same: bool, guard: Any) -> list[torch.Tensor] | None:
        """The tensors of the last push, read in place again: the caller pushes the very list
        it pushed last, its tensors checked to lie where they lay (``same``); else None."""
        kept = self._direct_of
        if kept is None or not same or guard is not None or kept[0] is not named:
            return None
        return kept[1] if named is self.preparer.planned_for else None

    def write_ahead(self) -> None:
        """Before a push whose caller is about to check that its tensors lie where the last
        push's lay (a :class:`ShardedSender` on GPUs): if the last push went the
        :meth:`lean` way with them too, make them ready now (cuda_ipc: the trainer's GPU
        starts writing into the receivers), and the push that follows, its tensors found
        in place, announces them. Found elsewhere, that push goes the usual way and writes
        them again: the bytes written ahead came from the kept views, whose memory they
        keep alive (never freed memory), and no receiver commits before the push's own
        announcement. The checks take 0.3 ms of a 4.1 GB update's start (the command of
        :meth:`lean`). The caller holds the sender's lock."""
        kept = self._direct_of
        members = self.lean(self._last_members) if self._here_last else None
        if members is None or kept is None:
            return
        assert self.parts.mailbox is not None
        self.parts.mailbox.ready(kept[1], [m.key for m in members])
        self._ahead = (members, kept[1])

    def forget_ahead(self) -> None:
        """The push after :meth:`write_ahead` did not run (its caller failed first)."""
        self._ahead = None
