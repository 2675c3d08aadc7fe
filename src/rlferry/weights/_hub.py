"""The sender's control service: who the receivers are and what each must do next.

It runs on the process's wire loop. Every receiver keeps one request parked
here (a long poll); the push, running in the caller's thread, moves the state
forward (plan, bucket k ready, abort) and every parked request whose receiver
can act on it is answered at once. The push waits for acknowledgements on an
event that every ack, failure and disconnect sets: nothing polls.

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

from ._errors import PushTimeout, WeightSyncError
from .protocol._datagrams import Commits, Starter
from .protocol._members import Member, Push
from .protocol._messages import (
    ABORTED,
    DONE,
    IDLE,
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

__all__ = ["JOIN_GRACE", "Hub", "Member", "Push"]

JOIN_GRACE = 2.0  # seconds a push waits for a receiver that joined to ask for work


class Hub:
    """Membership and dispatch; every method runs on the wire loop."""

    def __init__(self, group: str, transport: str) -> None:
        self.group = group
        self.transport = transport
        self.members: dict[bytes, Member] = {}
        self.push: Push | None = None
        self._changed = asyncio.Event()
        self._withdrawn = -1  # the last push given up before it began (see withdraw)
        self.on_leave: Callable[[bytes], None] = lambda key: None
        self.on_deadline: Callable[[], None] = lambda: None  # of the push in progress
        self._deadline: asyncio.TimerHandle | None = None
        self.store: Any = None  # a KeyValue when the broadcast group meets on this channel
        # a ShardedSender's rank: the group of every rank it is part of (see Describe)
        self.description: Described | None = None
        self.starter: Starter | None = None  # a collective sender's, for its members' lines
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
            if self.starter is not None and msg.line and self.starter.probe(msg.line):
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
        self._check_told(self.push)
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
        self._warn(m)
        return await fut

    def _warn(self, m: Member) -> None:
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
        self._settle(p)

    @staticmethod
    def _check_told(p: Push | None) -> None:
        if p is not None and all(m.told == p.seq or m.settled for m in p.members):
            p.told.set()

    def _settle(self, p: Push | None) -> None:
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
        self._settle(self.push)
        self._check_told(self.push)
        self._changed.set()

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
                m.parked.set_result(Setup(p.seq, plan or {}, p.setups[m.key], p.version))
            return
        if not p.streaming or m.step == DONE:
            return
        if p.collective:
            if m.step == PLAN and not p.direct:
                m.parked.set_result(Stream(p.seq, p.version, p.verify))
            return
        nxt = max(m.step + 1, m.want or 0)
        if nxt < p.ready:  # every bucket ready goes in one answer (one per answer with checksums)
            last = nxt if p.verify else p.ready - 1
            m.parked.set_result(Bucket(p.seq, p.version, nxt, p.checksums[nxt], last))

    def _dispatch_all(self) -> None:
        if self.push is not None:
            for m in self.push.members:
                self._dispatch(m)

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

    # -- a push, step by step (called from the pushing thread through the loop) -----------
    async def begin(
        self,
        push_args: dict[str, Any],
        wait_for: int,
        deadline: float,
        fast: Callable[[list[Member]], Push | None] | None = None,
    ) -> tuple[list[Member], Push | None]:
        """The members that take part: every idle one, once ``wait_for`` are (and every one
        that just joined asked for work, or its grace ran out); raises ``PushTimeout``
        naming who was seen doing what if too few are ready by ``deadline``.

        ``fast(members)``: the push, if these members need nothing before the stream (they
        hold the plan and the group): it starts streaming here, in the same hop, and is
        returned; else None, and the sender sets the members up and calls :meth:`start`."""

        def enough() -> bool:
            ms = self.members.values()
            return sum(m.idle for m in ms) >= wait_for and not any(
                (m.fresh and m.awaited) or m.returning for m in ms
            )

        seq = push_args["seq"]
        await self.until(lambda: enough() or self._withdrawn >= seq, deadline)
        if self._withdrawn >= seq:
            raise asyncio.CancelledError  # the pushing thread gave it up (see withdraw)
        members = [m for m in self.members.values() if m.idle]
        if len(members) < wait_for:
            raise PushTimeout(self._too_few(push_args, wait_for))
        self._arm_deadline(deadline)
        for m in members:
            m.seq, m.error, m.sent_setup, m.checksums = push_args["seq"], None, False, []
            m.step, m.want, m.late = IDLE, None, False
            m.version = push_args["version"]
        push = fast(members) if fast is not None else None
        if push is not None:
            await self.start(push, streaming=True)
        return members, push

    async def begin_direct(self, push: Push, deadline: float) -> tuple[list[Member], Push]:
        """Take part in ``push``, whose members the pushing thread started on their lines
        (see _line): streaming at once, their parked requests kept parked (each acks with a
        bare acknowledgement). A member that left meanwhile is marked failed: the pushing
        thread aborts the push before its stream."""
        self.take_part(push, deadline)
        return push.members, push

    def take_part(self, push: Push, deadline: float) -> None:
        """:meth:`begin_direct`, as a callback: also the push whose members the pushing
        thread picked itself, over a mailbox transport (they committed the last push and
        hold its plan and buffers: see ``WeightSender._lean``); its buckets are announced
        next, each member's parked request answered with them."""
        self._arm_deadline(deadline)
        for m in push.members:
            m.seq, m.error, m.sent_setup, m.checksums = push.seq, None, False, []
            m.step, m.want, m.late, m.version = PLAN, None, False, push.version
            m.returning = False
            if m.gone:
                m.error = "disconnected (its process died or it closed its receiver)"
        self.push = push
        push.streaming = True
        self._settle(push)

    def _arm_deadline(self, deadline: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        left = max(0.0, deadline - time.monotonic())
        self._deadline = asyncio.get_running_loop().call_later(left, self.on_deadline)

    def _too_few(self, push_args: dict[str, Any], wait_for: int) -> str:
        ms = list(self.members.values())
        ready = sum(m.idle for m in ms)
        head = f"push of version {push_args['version']}: {ready} of {wait_for} receivers"
        within = f"group {self.group!r} within {push_args['timeout']:g} s"
        how = "receivers join with WeightReceiver(..., address=sender.address).start()"
        busy = [m for m in ms if not m.idle]
        if not busy:
            return f"{head} joined {within} ({how})"
        seen = "; ".join(f"receiver `{m.name}` ({m.where}) {_doing(m)}" for m in busy)
        more = f"; {len(ms)} of {wait_for} joined ({how})" if len(ms) < wait_for else ""
        return f"{head} ready in {within}: {seen}{more}"

    async def start(self, push: Push, streaming: bool = False) -> None:
        """Send the plan (and buffers or group) to the members that need it; ``streaming``:
        none needs any, so the stream starts at once (one hop less on every push)."""
        self.push = push
        for m in push.members:
            if m.key not in push.setups:
                m.step = PLAN
        push.streaming = streaming
        self._dispatch_all()
        self._settle(push)  # members that left meanwhile

    async def planned(self, deadline: float) -> list[Member]:
        """Wait for every plan acknowledgement; the members that failed (rejected, gone, late)."""
        p = self.push
        assert p is not None
        await self.until(lambda: all(m.step >= PLAN or m.settled for m in p.members), deadline)
        self._late(p, "no acknowledgement of the plan", PLAN)
        return [m for m in p.members if m.error is not None]

    async def stream(self) -> None:
        assert self.push is not None
        self.push.streaming = True
        self._dispatch_all()

    def announce(self, k: int, checksum: int | None) -> None:
        p = self.push
        assert p is not None
        p.checksums.append(checksum)
        p.ready = k + 1
        self._dispatch_all()

    def announce_all(self, n: int) -> None:
        """Buckets 0..n-1 are all ready at once (zero copy: nothing to pack)."""
        p = self.push
        assert p is not None
        p.checksums.extend([None] * (n - p.ready))
        p.ready = n
        self._dispatch_all()

    async def free(self, k: int, deadline: float) -> list[bytes]:
        """Wait until every member acknowledged bucket ``k``; the keys of those that read it."""
        p = self.push
        assert p is not None
        await self.until(lambda: all(m.step >= k or m.settled for m in p.members), deadline)
        self._late(p, f"no acknowledgement of bucket {k}", k)
        return [m.key for m in p.members if m.error is None]

    async def finish(self, deadline: float) -> Push:
        """The push once every member settled; at the deadline, the ones that did not are
        marked late. (A pushing thread waits on ``push.settled`` first: this is the hop
        that names the late ones.)"""
        p = self.push
        assert p is not None
        await self.until(lambda: all(m.settled for m in p.members), deadline)
        self._late(p, "did not finish", DONE)
        return p

    async def withdraw(self, seq: int, lined: Push | None, deadline: float) -> Push | None:
        """The pushing thread gave push ``seq`` up before it knew its members (a Ctrl-C, an
        error): the push, if the members were told to set up or stream (its begin ran, or
        ``lined``, its starts on their lines may have gone: registered here), for the
        thread to abort; else None, and a begin of it that has not picked its members yet
        never will (its future may be lost: an interrupt in its very submission)."""
        p = self.push
        if p is not None and p.seq == seq:
            return p
        if lined is not None and lined.seq == seq:
            return (await self.begin_direct(lined, deadline))[1]
        self._withdrawn = seq
        self._changed.set()
        return None

    async def abort(self, reason: str, deadline: float) -> None:
        """Tell the members to drop this push; wait (until the deadline) for them to let go."""
        p = self.push
        if p is None:
            return
        p.aborted = reason
        self._dispatch_all()
        for m in p.members:
            self._warn(m)
        await self.until(lambda: all(m.settled for m in p.members), deadline)

    def _late(self, p: Push, what: str, step: int) -> None:
        for m in p.members:
            if not m.settled and m.step < step:
                m.error = f"{what} within the push's timeout"
                m.seq, m.late = -1, True  # later acks of this push are ignored
        self._settle(p)

    def done(self, committed: Push | None = None) -> None:
        """The push is over; ``committed``: it, ended on its members' word on the group
        that they committed (their acks, on their way, are waited for by the next push)."""
        if committed is not None:
            loop = asyncio.get_running_loop()
            for m in committed.members:
                m.returning = m.parked is None and not m.gone and m.seq == committed.seq
                if m.returning:  # awaited as one that just joined is, no longer
                    loop.call_later(JOIN_GRACE, self._not_back, m, committed.seq)
                if not m.settled:
                    m.step = DONE
        self.push = None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


def _doing(m: Member) -> str:
    """What a member that is not ready was last seen doing, and the likely cause."""
    if m.fresh:
        return (
            "joined but never asked for work (a peer that sent Join and nothing since, or a "
            "receiver whose thread is stuck or whose process is stopped)"
        )
    since = f"took part in the push of version {m.version}" if m.version is not None else "joined"
    return (
        f"{since} and has not asked for work since (a `load` or `on_commit` that does not "
        "return, or a stopped process)"
    )
