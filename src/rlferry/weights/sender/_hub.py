"""The sender's control service: who the receivers are and what each must do next.

It runs on the process's wire loop. Every receiver keeps one request parked
here (a long poll); the push, running in the caller's thread, moves the state
forward through its :class:`~._course.Course` (plan, bucket k ready, abort) and
every parked request whose receiver can act on it is answered at once. The push
waits for acknowledgements on an event that every ack, failure and disconnect
sets: nothing polls.

A push goes to the receivers that are ready (their request parked here). One
that just joined is waited for until its first request comes, for
:data:`JOIN_GRACE` seconds at most: a peer that joined and went quiet (a stuck
thread, a stopped process, a client that sent ``Join`` and nothing since)
holds up no push after that, and a push that fails for want of receivers names
each one that joined and what it was seen doing.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from .._errors import WeightSyncError
from ..protocol._datagrams import Commits, Starter
from ..protocol._members import Member, Push
from ..protocol._messages import (
    ABORTED,
    DONE,
    PLAN,
    Abort,
    Ack,
    Bucket,
    Describe,
    Described,
    Join,
    Leave,
    Noted,
    Setup,
    StoreOp,
    Stream,
    Watch,
    Welcome,
    decode_request,
    encode,
)

__all__ = ["JOIN_GRACE", "Hub"]

JOIN_GRACE = 2.0  # seconds a push waits for a receiver that joined to ask for work


class Hub:
    """Membership and dispatch; every method runs on the wire loop."""

    def __init__(self, group: str, transport: str) -> None:
        self.group = group
        self.transport = transport
        self.members: dict[bytes, Member] = {}
        self.push: Push | None = None
        self._changed = asyncio.Event()
        self.on_leave: Callable[[bytes], None] = lambda key: None
        self.store: Any = None  # a KeyValue when the broadcast group meets on this channel
        # a ShardedSender's rank: the group of every rank it is part of (see Describe)
        self.description: Described | None = None
        self.starter = Starter()  # to its members' start lines (see _line)
        self.commits: Commits | None = None  # a mailbox sender's commit line (see _line)

    # -- requests ---------------------------------------------------------------
    async def handle(self, value: Any, peer: bytes) -> bytes:
        msg = decode_request(value)
        if isinstance(msg, Describe):
            return encode(self._describe(msg.group))
        if isinstance(msg, Join):
            if msg.group != self.group:
                raise WeightSyncError(
                    f"group: expected {self.group!r} (this sender's), got {msg.group!r} (give "
                    "the group the sender was made with)"
                )
            if msg.transport and msg.transport != self.transport:
                raise WeightSyncError(
                    f"transport: the sender of group {self.group!r} uses {self.transport!r}, "
                    f"the receiver asked for {msg.transport!r}"
                )
            old = self.members.pop(peer, None)
            if old is not None:
                self._leave(old, "joined again")
            new = self.members[peer] = Member(peer, msg)
            if msg.line and self.starter.probe(msg.line):
                new.line = msg.line
            asyncio.get_running_loop().call_later(JOIN_GRACE, self._grace_over, new)
            self._changed.set()
            commits = self.commits.name if self.commits is not None else ""
            return encode(
                Welcome(self.group, self.transport, peer, os.getpid(), bool(new.line), commits)
            )
        if isinstance(msg, Watch):
            return encode(await self._watch(msg))
        m = self.members.get(peer)
        if m is None:
            raise WeightSyncError("unknown receiver: join first")
        if isinstance(msg, StoreOp):
            if self.store is None:
                raise WeightSyncError(
                    "store request: this sender's group does not meet on its control channel "
                    "(only a broadcast sender with a secret serves its rendezvous here)"
                )
            return encode(await self.store.serve(msg))
        if isinstance(msg, Leave):
            self.members.pop(peer, None)
            self._leave(m, "closed its receiver")
            return encode(Noted())
        m.returning = False
        m.holds = msg.holds if msg.holds >= 0 else None
        self._acked(m, msg)
        if not msg.park:
            self._changed.set()
            return encode(Noted())
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        m.parked, m.want, m.fresh = fut, msg.want, False
        self._dispatch(m)
        self._changed.set()
        try:
            reply = encode(await fut)
        finally:
            if m.parked is fut:
                m.parked = None
        m.told = m.seq  # the server sends the reply in this step
        self.check_told(self.push)
        return reply

    async def _watch(self, w: Watch) -> Abort | Noted:
        """Park a receiver's Watch until a push it takes part in is aborted, or it left."""
        m = self.members.get(w.key)
        if m is None:
            return Noted()  # it left (or joined again, under a new key)
        if m.watch is not None and not m.watch.done():
            m.watch.set_result(Noted())
        fut = m.watch = asyncio.get_running_loop().create_future()
        m.watch_seen = w.seen
        self.warn(m)
        return await fut

    def warn(self, m: Member) -> None:
        """Answer ``m``'s Watch if the push it takes part in is aborted."""
        p = self.push
        fut = m.watch
        if fut is None or fut.done() or p is None or p.aborted is None or p.seq <= m.watch_seen:
            return
        if m in p.members and m.seq == p.seq and not m.settled:
            fut.set_result(Abort(p.seq, p.aborted, p.version))

    def _describe(self, group: str) -> Described:
        d = self.description
        if d is not None and group == d.group:
            return d
        if group == self.group:
            return Described(group)  # one sender on its own
        known = [g for g in (d.group if d else None, self.group) if g is not None]
        raise WeightSyncError(
            f"group: expected {' or '.join(map(repr, known))} (this sender's), got {group!r} "
            "(give the group the sender was made with)"
        )

    def _acked(self, m: Member, ack: Ack) -> None:
        p = self.push
        if p is None or ack.seq != p.seq or m.seq != p.seq:
            return  # an ack of an older push (a receiver that was late), or idle
        if ack.error is not None and m.error is None:
            m.error = ack.error
        if ack.step == PLAN:
            m.sent_setup = False
            if ack.error is None:
                m.plan, m.handles, m.targets = p.fingerprint, ack.handles, ack.targets
                m.generation = p.setups.get(m.key, {}).get("generation", m.generation)
        if ack.step > m.step or ack.step == ABORTED:
            m.step = ack.step
        if ack.checksums:
            m.checksums = ack.checksums
        self.settle(p)

    @staticmethod
    def check_told(p: Push | None) -> None:
        """Set ``p.told`` once every member's message of it is on its way."""
        if p is not None and all(m.told == p.seq or m.settled for m in p.members):
            p.told.set()

    def settle(self, p: Push | None) -> None:
        """Set ``p.settled`` once every member settled (and wake the commit line's wait)."""
        if p is not None and not p.settled.is_set() and all(m.settled for m in p.members):
            p.settled.set()
            if self.commits is not None:  # the pushing thread may wait on the commit line
                self.commits.wake()

    def disconnected(self, peer: bytes) -> None:
        m = self.members.pop(peer, None)
        if m is not None:
            self._leave(m, "disconnected (its process died or it closed its receiver)")

    def _leave(self, m: Member, reason: str) -> None:
        m.gone = True
        if m.error is None and self.push is not None and m in self.push.members:
            m.error = reason
        if m.parked is not None and not m.parked.done():
            m.parked.cancel()
        if m.watch is not None and not m.watch.done():
            m.watch.set_result(Noted())
        self.on_leave(m.key)
        self.settle(self.push)
        self.check_told(self.push)
        self._changed.set()

    def expect_back(self, committed: Push) -> None:
        """``committed`` ended on its members' word on the group that they committed: their
        acks, on their way, are waited for by the next push (as a member that just joined
        is, :data:`JOIN_GRACE` seconds at most)."""
        loop = asyncio.get_running_loop()
        for m in committed.members:
            m.returning = m.parked is None and not m.gone and m.seq == committed.seq
            if m.returning:
                loop.call_later(JOIN_GRACE, self._not_back, m, committed.seq)
            if not m.settled:
                m.step = DONE

    def _not_back(self, m: Member, seq: int) -> None:
        if m.returning and m.seq == seq:
            m.returning = False
            self._changed.set()

    def _grace_over(self, m: Member) -> None:
        m.awaited = False
        self._changed.set()

    # -- dispatch -----------------------------------------------------------------
    def _dispatch(self, m: Member) -> None:
        if not m.idle:
            return
        p = self.push
        if p is None or m.seq != p.seq or m.error is not None or m not in p.members:
            return
        assert m.parked is not None
        if p.aborted is not None:
            if m.step not in (DONE, ABORTED):
                m.parked.set_result(Abort(p.seq, p.aborted, p.version))
            return
        if m.step < PLAN:
            if not m.sent_setup and m.key in p.setups:
                m.sent_setup = True
                plan = p.plan if m.plan != p.fingerprint else {"same": p.fingerprint}
                m.parked.set_result(Setup(p.seq, plan or {}, p.setups[m.key], p.version, p.delta))
            return
        if not p.streaming or m.step == DONE:
            return
        if p.collective:
            if m.step == PLAN and not p.direct:
                m.parked.set_result(Stream(p.seq, p.version, p.verify))
            return
        if m.key in p.lined:  # told on its line: its request stays parked
            return
        nxt = max(m.step + 1, m.want or 0)
        if nxt < p.ready:  # every bucket ready goes in one answer (one per answer with checksums)
            last = nxt if p.verify else p.ready - 1
            m.parked.set_result(Bucket(p.seq, p.version, nxt, p.checksums[nxt], last))

    def dispatch_all(self) -> None:
        """Answer every member of the push in progress that can act now."""
        if self.push is not None:
            for m in self.push.members:
                self._dispatch(m)

    def changed(self) -> None:
        """Wake every :meth:`until` to check its condition again."""
        self._changed.set()

    async def until(self, pred: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``pred()`` holds (re-checked on every change); False at the deadline."""
        while not pred():
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return pred()
        return True
