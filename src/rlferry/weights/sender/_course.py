"""A push's course at the hub, step by step: its members picked (or taken from the pushing
thread), set up, streaming, bucket by bucket, then finished or aborted. Every step runs
on the wire loop, called from the pushing thread; the :class:`~._hub.Hub` answers the
members as each step moves the push on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from .._errors import PushTimeout, WeightSyncError
from ..protocol._members import Member, Push
from ..protocol._messages import DONE, IDLE, PLAN
from ._hub import Hub

__all__ = ["Course", "MembersChanged"]


class MembersChanged(WeightSyncError):
    """The members a push found are not those it was made for (a delta push, and one of
    them lacks its base: it joined since, say): nothing started; the sender makes the push
    again, full."""


class Course:
    """The course of each push over ``hub``'s members; every method runs on the wire loop.
    ``on_deadline`` is called at the deadline of the push in progress."""

    def __init__(self, hub: Hub, on_deadline: Callable[[], None] = lambda: None) -> None:
        self.hub = hub
        self.on_deadline = on_deadline
        self._deadline: asyncio.TimerHandle | None = None
        self._withdrawn = -1  # the last push given up before it began (see withdraw)

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
        returned; else None, and the sender sets the members up and calls :meth:`start`.
        ``push_args["accept"]`` (if given) ``(members)``: False if the push was made for
        others (raises ``MembersChanged``, nothing started)."""

        def enough() -> bool:
            ms = self.hub.members.values()
            return sum(m.idle for m in ms) >= wait_for and not any(
                (m.fresh and m.awaited) or m.returning for m in ms
            )

        seq = push_args["seq"]
        await self.hub.until(lambda: enough() or self._withdrawn >= seq, deadline)
        if self._withdrawn >= seq:
            raise asyncio.CancelledError  # the pushing thread gave it up (see withdraw)
        members = [m for m in self.hub.members.values() if m.idle]
        if len(members) < wait_for:
            raise PushTimeout(self._too_few(push_args, wait_for))
        accept = push_args.get("accept")
        if accept is not None and not accept(members):
            raise MembersChanged("the push's members are not those it was made for")
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
        (see ``protocol._datagrams``): streaming at once, their parked requests kept parked
        (each acks with a bare acknowledgement). A member that left meanwhile is marked
        failed: the pushing thread aborts the push before its stream."""
        self.take_part(push, deadline)
        return push.members, push

    def take_part(self, push: Push, deadline: float) -> None:
        """:meth:`begin_direct`, as a callback: also the push whose members the pushing
        thread picked itself, over a mailbox transport (they committed the last push and
        hold its plan and buffers: see ``Launcher.lean``); its buckets are announced
        next, each member's parked request answered with them."""
        self._arm_deadline(deadline)
        for m in push.members:
            m.seq, m.error, m.sent_setup, m.checksums = push.seq, None, False, []
            m.step, m.want, m.late, m.version = PLAN, None, False, push.version
            m.returning = False
            if m.gone:
                m.error = "disconnected (its process died or it closed its receiver)"
        self.hub.push = push
        push.streaming = True
        self.hub.settle(push)

    def _arm_deadline(self, deadline: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        left = max(0.0, deadline - time.monotonic())
        self._deadline = asyncio.get_running_loop().call_later(left, self.on_deadline)

    def _too_few(self, push_args: dict[str, Any], wait_for: int) -> str:
        ms = list(self.hub.members.values())
        ready = sum(m.idle for m in ms)
        head = f"push of version {push_args['version']}: {ready} of {wait_for} receivers"
        within = f"group {self.hub.group!r} within {push_args['timeout']:g} s"
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
        self.hub.push = push
        for m in push.members:
            if m.key not in push.setups:
                m.step = PLAN
        push.streaming = streaming
        self.hub.dispatch_all()
        self.hub.settle(push)  # members that left meanwhile

    async def planned(self, deadline: float) -> list[Member]:
        """Wait for every plan acknowledgement; the members that failed (rejected, gone, late)."""
        p = self.hub.push
        assert p is not None
        await self.hub.until(lambda: all(m.step >= PLAN or m.settled for m in p.members), deadline)
        self._late(p, "no acknowledgement of the plan", PLAN)
        return [m for m in p.members if m.error is not None]

    async def stream(self) -> None:
        assert self.hub.push is not None
        self.hub.push.streaming = True
        self.hub.dispatch_all()

    def announce(self, k: int, checksum: int | None) -> None:
        p = self.hub.push
        assert p is not None
        p.checksums.append(checksum)
        p.ready = k + 1
        self.hub.dispatch_all()

    def announce_all(self, n: int) -> None:
        """Buckets 0..n-1 are all ready at once (zero copy: nothing to pack)."""
        p = self.hub.push
        assert p is not None
        p.checksums.extend([None] * (n - p.ready))
        p.ready = n
        self.hub.dispatch_all()

    async def free(self, k: int, deadline: float) -> list[bytes]:
        """Wait until every member acknowledged bucket ``k``; the keys of those that read it."""
        p = self.hub.push
        assert p is not None
        await self.hub.until(lambda: all(m.step >= k or m.settled for m in p.members), deadline)
        self._late(p, f"no acknowledgement of bucket {k}", k)
        return [m.key for m in p.members if m.error is None]

    async def finish(self, deadline: float) -> Push:
        """The push once every member settled; at the deadline, the ones that did not are
        marked late. (A pushing thread waits on ``push.settled`` first: this is the hop
        that names the late ones.)"""
        p = self.hub.push
        assert p is not None
        await self.hub.until(lambda: all(m.settled for m in p.members), deadline)
        self._late(p, "did not finish", DONE)
        return p

    async def withdraw(self, seq: int, lined: Push | None, deadline: float) -> Push | None:
        """The pushing thread gave push ``seq`` up before it knew its members (a Ctrl-C, an
        error): the push, if the members were told to set up or stream (its begin ran, or
        ``lined``, its starts on their lines may have gone: registered here), for the
        thread to abort; else None, and a begin of it that has not picked its members yet
        never will (its future may be lost: an interrupt in its very submission)."""
        p = self.hub.push
        if p is not None and p.seq == seq:
            return p
        if lined is not None and lined.seq == seq:
            return (await self.begin_direct(lined, deadline))[1]
        self._withdrawn = seq
        self.hub.changed()
        return None

    async def abort(self, reason: str, deadline: float) -> None:
        """Tell the members to drop this push; wait (until the deadline) for them to let go."""
        p = self.hub.push
        if p is None:
            return
        p.aborted = reason
        self.hub.dispatch_all()
        for m in p.members:
            self.hub.warn(m)
        await self.hub.until(lambda: all(m.settled for m in p.members), deadline)

    def _late(self, p: Push, what: str, step: int) -> None:
        for m in p.members:
            if not m.settled and m.step < step:
                m.error = f"{what} within the push's timeout"
                m.seq, m.late = -1, True  # later acks of this push are ignored
        self.hub.settle(p)

    def done(self, committed: Push | None = None) -> None:
        """The push is over; ``committed``: it, ended on its members' word on the group
        that they committed (their acks, on their way, are waited for by the next push)."""
        if committed is not None:
            self.hub.expect_back(committed)
        self.hub.push = None
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
