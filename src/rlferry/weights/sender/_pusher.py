"""A sender's pushes, each run step by step from its start to its report by the pieces
that own each part of it: the :class:`Preparer` (the plan, the packer, the setups), the
:class:`Launcher` (how the push starts) and the :class:`Finisher` (its stream, its
commits and report, or its abort). A :class:`WeightSender` has one; a
:class:`ShardedSender` one per link."""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch

from rlferry.errors import RequestError

from .._config import SenderConfig
from .._errors import DeltaBaseMissing, SenderClosed, WeightSyncError
from .._report import PushReport, SenderStatistics
from ..copies._pack import bucketed
from ..planning._buckets import Plan
from ..protocol._members import Member, Push
from ..protocol._messages import Described
from ._course import MembersChanged
from ._finishing import Finisher, error_class, failures_text
from ._launching import Launcher
from ._parts import SenderParts
from ._preparing import Preparer

__all__ = ["Pusher"]

Named = Iterable[Any] | Callable[[], tuple[list[Any], bool, Any]]


def _sent(begun: concurrent.futures.Future[Any], deadline: float) -> None:
    """Wait (at most until ``deadline``; the results are read later) for the wire loop to
    pick a push's members and, on the fast way, to send them the start: holding the GIL,
    this thread would keep the loop from it until its next blocking call (the starts
    go out 0.4-0.6 ms into a push while it reads its tensors and packs, on four H100s)."""
    concurrent.futures.wait([begun], max(0.0, deadline - time.monotonic()))
    if begun.done() and not begun.cancelled() and begun.exception() is None:
        push = begun.result()[1]
        if push is not None:
            push.told.wait(max(0.0, deadline - time.monotonic()))


class Pusher:
    """One sender's pushes over its parts, one at a time."""

    def __init__(self, config: SenderConfig) -> None:
        self.parts = parts = SenderParts(config)
        self.preparer = Preparer(parts)
        self.launcher = Launcher(parts, self.preparer)
        self.finisher = Finisher(parts, self.preparer, self.launcher)
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._first = True
        self._moving = False  # the push in progress got past its plan: buckets may move
        self._closed = False

    @property
    def address(self) -> str:
        return self.parts.address

    # -- what a ShardedSender sets for each of its links -------------------------------
    def cap_buckets(self, cap: int) -> None:
        """Make the default bucket at most ``cap`` bytes (see :meth:`Preparer.cap_buckets`)."""
        with self._lock:
            self.preparer.cap_buckets(cap)

    def cap_ctas(self, ctas: int) -> None:
        """Let this sender's broadcast group (NCCL) take at most ``ctas`` thread blocks, at
        its end and every receiver's: a :class:`ShardedSender` bounds the memory NCCL takes
        for each of its rank's links. Used when the group next forms; other transports
        ignore it."""
        if self.parts.collective is not None:
            self.parts.collective.max_ctas = ctas

    def describe_as(self, description: Described) -> None:
        """Answer a ``Describe`` of ``description.group`` with it: this sender is rank 0
        of a :class:`ShardedSender` group, and its address is the one engines are told."""
        hub = self.parts.hub

        async def set_it() -> None:
            hub.description = description

        self.parts.loop.run(set_it())

    def write_ahead(self) -> None:
        """See :meth:`Launcher.write_ahead`."""
        with self._lock:
            self.launcher.write_ahead()

    def forget_ahead(self) -> None:
        self.launcher.forget_ahead()

    # -- the push -----------------------------------------------------------------------
    def steps(
        self, named: Named, version: int, timeout: float,
        layout: Iterable[tuple[str, Any]] | None = None, delta: dict[str, Any] | None = None,
        accept: Callable[[list[Member]], bool] | None = None,
    ) -> Generator[bool | None, None, PushReport]:  # fmt: skip
        """:meth:`WeightSender.push` as steps, for a caller that drives several senders'
        pushes in one thread (:func:`drain` runs one): the first step starts the push (a
        push whose receivers hold its plan starts streaming there), each later one packs
        and sends a bucket, the last waits for the commits; the report is the generator's
        value. On NCCL a step only enqueues work, so one thread keeps every link of a rank
        busy; a step yields True when the next one blocks (the GPU's sends, the commits),
        so that the thread enqueues the other links' buckets first (:func:`take_turns`).

        ``named`` may be a callable giving ``(named, same, guard)`` once the push started
        (the caller's tensors are made ready while the receivers get the start); ``same``:
        the list object pushed last, whose tensors the caller checked are the same (same
        memory, same layout), so their checks are skipped; ``guard``: None, or called with
        each bucket's tensor indices and list before the bucket is packed, to replace
        tensors of it (in the list, and in ``named``) that the caller finds stale then
        (it returns their indices). Such a caller must push the
        layout of the last push (a push that started streaming the old one fails, aborted).

        ``delta``: a delta push's header (``named``, a list, holds its encoded tensors):
        every member gets a Setup carrying it, and the push is packed (its tensors are new
        each push: exporting them for zero copy would cost more than packing them).
        ``accept(members)`` is asked on the wire loop once the members are known: False
        raises ``MembersChanged`` before anything started."""
        if type(version) is not int:
            raise RequestError(f"push.version: expected an int, got {version!r}")
        if self._closed:
            raise SenderClosed(
                f"push of version {version}: the sender of group {self.parts.config.group!r} "
                "is closed (make a new WeightSender)"
            )
        with self._lock:
            kept = self.preparer.kept()
            self._moving = False
            try:
                return (yield from self._push(named, version, timeout, layout, delta, accept))
            except BaseException as e:
                if not self._moving:  # it failed before any bucket moved: it leaves nothing
                    self.preparer.restore(kept)
                    if self.parts.mailbox is not None:
                        self.parts.mailbox.abandon()
                if isinstance(e, WeightSyncError) and not isinstance(e, MembersChanged):
                    self.parts.counts.failed += 1
                raise

    def _push(
        self, named: Named, version: int, timeout: float,
        layout: Iterable[tuple[str, Any]] | None, delta: dict[str, Any] | None,
        accept: Callable[[list[Member]], bool] | None,
    ) -> Generator[bool | None, None, PushReport]:  # fmt: skip
        parts, prep, launcher, finisher = self.parts, self.preparer, self.launcher, self.finisher
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        seq = next(self._seq)
        wait_for = parts.config.receivers if self._first else 1
        last, ahead = launcher.take()
        if callable(named) and not self._first:
            members = ahead[0] if ahead is not None else launcher.lean(last)
            if members is not None:  # the caller's tensors are read first: no loop to wait for
                given = named()
                kept = launcher.kept_direct(*given)
                if kept is not None and (ahead is None or ahead[1] is kept):
                    return (yield from self._push_here(
                        members, kept, given[0], seq, version, t0, deadline, ahead is not None
                    ))  # fmt: skip
                named = lambda: given  # noqa: E731  (the usual way, with what it gave)
        run = parts.loop.run
        args = {"seq": seq, "version": version, "timeout": timeout, "accept": accept}
        begun: concurrent.futures.Future[tuple[list[Member], Push | None]] | None = None
        fast = early = None
        lined = False  # started on the members' lines (see Launcher.begin)
        buckets: Iterator[tuple[int, list[Any]]] | None = None
        same, guard = False, None
        try:  # until the members are known: a push the hub started is aborted, not left
            if callable(named):
                early = prep.plan
                if not self._first and early is not None:
                    fast = prep.fast(early, seq, version)
                    begun, lined = launcher.begin(fast, args, wait_for, deadline)
                    yield False  # the caller's other pushes start too
                    if not lined:  # the receivers get the start while tensors are read
                        _sent(begun, deadline)
                named, same, guard = named()
            if same and prep.plan is not None and named is prep.planned_for:
                plan, checked = prep.plan, False
            else:
                same = False
                named, plan, checked = prep.layout(named, layout)
            if guard is not None:
                buckets = self._guarded(bucketed(plan, named, checked), guard, plan)
            if begun is None:
                fast = prep.fast(plan, seq, version) if not self._first and not delta else None
                begun, lined = launcher.begin(fast, args, wait_for, deadline)
                if fast is not None and not lined:
                    _sent(begun, deadline)  # the receivers get the start while bucket 0 packs
            elif plan is not early:
                fast = None
                if begun.result()[1] is not None:  # a started stream carries the old plan
                    raise WeightSyncError("the layout changed after the push started (a bug)")
            if fast is not None:  # bucket 0 is packed while the loop picks the members
                assert prep.packer is not None
                prep.packer.same = same
                rest = buckets or bucketed(plan, named, checked)
                first = next(rest)
                prep.packer.pack(*first)
                buckets = itertools.chain([first], rest)
            members, push = begun.result()
            if push is not None and push.direct:
                launcher.lines_started(push)
        except BaseException as e:
            finisher.abandon(begun, e, deadline, seq, lined)
        self._first = False
        mail, coll = parts.mailbox, parts.collective
        if push is not None:  # the members hold the plan and the group: streaming already
            self._moving = True
            return (yield from finisher.finish(
                push, plan, named, checked, t0, deadline, buckets, packed=True
            ))  # fmt: skip
        plan_sent = any(m.plan != plan.fingerprint for m in members)
        verify = any(m.verify for m in members)
        direct: list[torch.Tensor] | None = None
        if parts.config.zero_copy and mail is not None and not (checked or verify or delta):
            assert prep.device is not None
            direct = [t for _, t in named]
            if not mail.use_direct(direct, prep.device):
                named = iter([(s.name, t) for s, t in zip(plan.specs, direct, strict=True)])
                direct = None
        if direct is None and mail is not None:
            mail.use_packed()
        launcher.keep_direct(named, direct)
        setups = prep.setups(members, plan, timeout, every=delta is not None)
        push = Push(
            seq, version, plan.to_wire() if plan_sent else None, plan.fingerprint, members,
            setups, coll is not None, verify, delta=delta,
        )  # fmt: skip
        if not setups:  # every member holds the plan and the buffers: stream at once
            self._moving = True
        if prep.packer is not None:
            prep.packer.same = same
        try:  # interrupted, the start ran on the loop or never will: either way, aborted
            run(parts.course.start(push, streaming=not setups))
        except BaseException as e:
            finisher.fail(e, push, deadline)
        if setups:
            try:
                if coll is not None:
                    coll.form(deadline)
                rejected = run(parts.course.planned(deadline))
                if rejected:
                    cls: type[WeightSyncError] = WeightSyncError
                    if delta is not None and any(m.holds != delta["base"] for m in rejected):
                        cls = DeltaBaseMissing  # a receiver lacks the base (it says why)
                    raise error_class(rejected, cls)(
                        f"push of version {version}: {failures_text(rejected)}; no bucket moved",
                        {m.name: m.error or "" for m in rejected},
                    )
                if mail is not None:
                    for m in members:
                        if m.key in setups and m.error is None:
                            try:
                                mail.receiver_attached(m.key, m.handles, m.targets)
                            except WeightSyncError:
                                m.plan = ""  # set up again next push: it must not load nothing
                                raise
                self._moving = True
                run(parts.course.stream())
            except BaseException as e:
                finisher.fail(e, push, deadline)
        return (yield from finisher.finish(
            push, plan, named, checked, t0, deadline, buckets, direct=direct
        ))  # fmt: skip

    def _push_here(
        self, members: list[Member], direct: list[torch.Tensor], named: Any, seq: int,
        version: int, t0: float, deadline: float, written: bool,
    ) -> Generator[bool | None, None, PushReport]:  # fmt: skip
        """A push of :meth:`Launcher.lean`'s members, started by this thread: the hub takes
        part (a callback, not waited for), the tensors are made ready (written into
        receivers that offered theirs; ``written``: already, see
        :meth:`Launcher.write_ahead`), then every bucket is announced at once: on each
        member's start line, else its parked request answered. Given up before the hub
        took part, it is registered and aborted all the same (see
        :meth:`Finisher.abandon`): its receivers may have been written."""
        plan = self.preparer.plan
        assert plan is not None
        push = Push(seq, version, None, plan.fingerprint, members, {}, False, False)
        self.launcher.lining = push
        parts = self.parts
        try:
            parts.loop.loop.call_soon_threadsafe(parts.course.take_part, push, deadline)
        except BaseException as e:
            self.finisher.abandon(None, e, deadline, seq, lined=True)
        self._moving = True
        self.launcher.started_here()
        return (yield from self.finisher.finish(
            push, plan, named, False, t0, deadline, direct=direct, written=written, lines=True
        ))  # fmt: skip

    def _guarded(
        self, buckets: Iterator[tuple[int, list[Any]]], guard: Callable[..., list[int]],
        plan: Plan,
    ) -> Iterator[tuple[int, list[Any]]]:  # fmt: skip
        """``buckets``, ``guard`` asked before each is packed (see :meth:`steps`); the
        buckets of the tensors it replaced are packed anew (grouped copies built again)."""
        per = plan.order[0]
        for k, tensors in buckets:
            replaced = guard(per[k], tensors)
            if replaced and self.preparer.packer is not None:
                self.preparer.packer.forget(replaced)
            yield k, tensors

    # -- the rest -----------------------------------------------------------------------
    def statistics(self) -> SenderStatistics:
        parts, counts, plan = self.parts, self.parts.counts, self.preparer.plan
        config = parts.config
        return SenderStatistics(
            group=config.group,
            transport=config.transport,
            address=parts.address,
            receivers=sum(not m.gone for m in parts.hub.members.values()),
            pushes=counts.pushes,
            failed_pushes=counts.failed,
            bytes_pushed=counts.bytes,
            last_push_seconds=counts.last_seconds,
            bucket_bytes=plan.bucket_bytes if plan else config.bucket_bytes or 0,
            buffer_bytes=parts.transport.buffer_bytes,
            plans_sent=counts.plans,
            groups_formed=parts.transport.groups_formed,
            started_on_lines=counts.lines,
            started_here=counts.here,
            commits_on_line=counts.line,
        )

    def close(self) -> None:
        """Stop serving; receivers see the sender gone and keep their last version."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self.parts.close()
