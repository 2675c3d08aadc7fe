"""The end of a push: its buckets streamed (or, zero copy, made ready at once), the
members' commits waited for (on the commit line, else the hub's word), the report; and a
push given up on the way, aborted at the hub. :class:`~._pusher.Pusher` starts the push."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Generator, Iterable, Iterator
from typing import Any, NoReturn

import torch

from .._errors import PushTimeout, WeightSyncError
from .._report import PushReport
from ..copies._pack import bucketed
from ..planning._buckets import Plan
from ..protocol._members import Member, Push
from ..protocol._messages import Bucket, encode
from ..transports._base import checksum
from ._launching import Launcher
from ._parts import SenderParts
from ._preparing import Preparer

__all__ = ["Finisher", "error_class", "failures_text"]


def error_class(
    failed: list[Member], default: type[WeightSyncError] = WeightSyncError
) -> type[WeightSyncError]:
    """``PushTimeout`` if one of ``failed`` missed the push's timeout, else ``default``."""
    return PushTimeout if any(m.late for m in failed) else default


def failures_text(failed: list[Member]) -> str:
    """Each failed member named, where it runs, and why."""
    return "; ".join(f"receiver `{m.name}` ({m.where}): {m.error}" for m in failed)


class Finisher:
    """How a sender's pushes end: streamed and committed, or aborted."""

    def __init__(self, parts: SenderParts, preparer: Preparer, launcher: Launcher) -> None:
        self.parts = parts
        self.preparer = preparer
        self.launcher = launcher

    def abandon(
        self,
        begun: concurrent.futures.Future[Any] | None,
        e: BaseException,
        deadline: float,
        seq: int,
        lined: bool = False,
    ) -> NoReturn:
        """Raise ``e``, met before the members were known; a push the hub started is aborted,
        not left. A begin still waiting for its members is cancelled (it starts nothing);
        one started on the members' lines (``lined``) is not: their starts went. The hub
        is asked on its loop, after the cancel, whether the push started (there a begin
        either started it or never will): the future alone cannot say. A begin that
        started the push, its result not yet passed to the future, is cancelled all the
        same, and a Ctrl-C in the begin's very submission leaves no future to ask; a
        receiver left streaming would take the next push's buckets as this one's."""
        if begun is not None and not lined:
            begun.cancel()
        parts = self.parts
        started = parts.loop.run(parts.course.withdraw(seq, self.launcher.lining, deadline))
        if started is None:
            raise e
        self.fail(e, started, deadline)

    def fail(self, e: BaseException, push: Push, deadline: float) -> NoReturn:
        """Abort ``push`` after ``e`` and raise: ``e`` itself, or, for a WeightSyncError that
        names nobody, one naming the members that failed."""
        parts = self.parts
        coll, version = parts.collective, push.version
        reason = f"the sender failed: {type(e).__name__}: {e}"
        if coll is not None:
            coll.broken()
        now = time.monotonic()  # members get a second at least to let go, 5 s at most
        parts.loop.run(parts.course.abort(reason, max(min(deadline, now + 5), now + 1)))
        if isinstance(e, PushTimeout):  # the ones that did not let go are named
            parts.loop.run(parts.course.finish(now))
        parts.loop.loop.call_soon_threadsafe(parts.course.done)
        if isinstance(e, WeightSyncError) and not e.failures:
            failed = [m for m in push.members if m.error is not None]
            more = f"; {failures_text(failed)}" if failed else ""
            raise error_class(failed, type(e))(
                f"push of version {version}: {e}{more}", {m.name: m.error or "" for m in failed}
            ) from None
        raise e

    def finish(
        self, push: Push, plan: Plan, named: Iterable[Any], checked: bool, t0: float,
        deadline: float, buckets: Iterator[tuple[int, list[Any]]] | None = None,
        packed: bool = False, direct: list[torch.Tensor] | None = None, written: bool = False,
        lines: bool = False,
    ) -> Generator[bool | None, None, PushReport]:  # fmt: skip
        """Stream the buckets of a started push and wait for the members' commits.
        ``buckets``: ``named`` already bucketed (bucket 0 taken, and ``packed`` into
        buffer 0 if the push went the fast way; else packed again). ``lines``: a zero-copy
        push this thread started alone tells its members on their start lines."""
        parts = self.parts
        mail, coll, verify, version = parts.mailbox, parts.collective, push.verify, push.version
        hub, course, counts = parts.hub, parts.course, parts.counts
        call = parts.loop.loop.call_soon_threadsafe
        committed = False  # every member said so on the group (see transports._groups)
        try:
            if direct is not None:
                assert mail is not None
                if not written:
                    mail.ready(direct, [m.key for m in push.members if m.error is None])
                # receivers read the tensors in place (or the sender wrote them into theirs):
                # every bucket is ready, in one word (on a member's line, else the hub's)
                if lines:
                    self._tell_on_lines(push, plan.buckets)
                call(course.announce_all, plan.buckets)
            elif coll is not None:
                buckets = buckets or bucketed(plan, named, checked)
                committed = yield from coll.stream(
                    plan, buckets, self.preparer.packer, verify, deadline, packed
                )
            else:
                yield from self._stream_mailbox(
                    plan, buckets or bucketed(plan, named, checked), verify, deadline
                )
            yield True  # this push waits for its commits once the caller's others streamed
            # every member's commit comes to this thread on the commit line (mailbox), else
            # wakes it from the loop at once; at the deadline, the loop names the late ones
            p = push
            if mail is not None and hub.commits is not None:
                pids = {m.key: m.pid for m in push.members}
                committed = hub.commits.wait(push.seq, pids, push.settled, deadline)
                counts.line += committed
            if not committed and not push.settled.wait(max(0.0, deadline - time.monotonic())):
                p = parts.loop.run(course.finish(deadline))
        except BaseException as e:
            self.fail(e, push, deadline)
        call(course.done, push if committed else None)
        seconds = time.perf_counter() - t0
        counts.last_seconds = seconds
        if committed:  # their acks are on their way: the next push waits for them
            ok, failed = tuple(m.name for m in p.members), []
        else:
            ok = tuple(m.name for m in p.members if m.error is None and m.step > 0)
            failed = [m for m in p.members if m.error is not None]
        every = mail is not None and not failed and len(ok) == len(p.members)
        self.launcher.ended(p.members, on_group=committed, every=every)
        report = PushReport(
            version, plan.nbytes, seconds, ok, len(plan.specs), plan.buckets, push.plan is not None
        )
        counts.pushes += 1
        counts.bytes += plan.nbytes
        if failed:
            if coll is not None:
                coll.broken()
            some = f"{len(ok)} committed it" if ok else "none committed it"
            raise error_class(failed)(
                f"push of version {version}: {failures_text(failed)}; {some}",
                {m.name: m.error or "" for m in failed},
                report,
            )
        return report

    def _tell_on_lines(self, push: Push, buckets: int) -> None:
        """Tell each member of ``push`` on its start line that its ``buckets`` buckets are
        all ready (one ``Bucket``; see ``protocol._datagrams``), before the hub is asked
        to: a member whose line took it is not answered by the hub. The hops the line
        skips (to the wire loop, its answer, ZeroMQ's I/O threads) took 0.9 ms of a
        Qwen3-8B push's 10.5 on an H200."""
        starter = self.parts.hub.starter
        msg = encode(Bucket(push.seq, push.version, 0, None, buckets - 1))
        for m in push.members:
            if m.line and m.error is None and starter.send(m.line, msg) is None:
                push.lined.add(m.key)
        if len(push.lined) == len(push.members):
            self.parts.counts.lines += 1

    def _stream_mailbox(
        self, plan: Plan, buckets: Iterator[tuple[int, list[Any]]], verify: bool,
        deadline: float,
    ) -> Generator[bool | None, None, None]:  # fmt: skip
        parts = self.parts
        tr, hub, course, packer = parts.mailbox, parts.hub, parts.course, self.preparer.packer
        assert tr is not None and packer is not None and packer.plan is plan
        members = hub.push.members if hub.push else []
        readers = [m.key for m in members]
        call = parts.loop.loop.call_soon_threadsafe
        for k, tensors in buckets:
            b = k % 2
            if k >= 2 and not all(m.step >= k - 2 or m.settled for m in members):
                readers = parts.loop.run(course.free(k - 2, deadline))
            elif k >= 2:  # every ack already came: no need to ask the loop
                readers = [m.key for m in members if m.error is None]
            tr.before_pack(b, readers)
            packer.pack(k, tensors)
            tr.after_pack(b)
            sum_ = checksum(tr.buffer(b)[: plan.bucket_used[k]]) if verify else None
            call(course.announce, k, sum_)
            yield False
