"""The sender: plans a push, packs buckets into the transport's buffers, collects the results."""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch

from rlferry.errors import RequestError
from rlferry.wire import Server, default_address, wire_loop

from ._config import SenderConfig
from ._errors import SenderClosed, WeightSyncError
from ._finishing import PushFinishing, error_class
from ._hub import Hub, Member, Push
from ._report import PushReport, SenderStatistics
from ._turns import drain
from .copies._pack import Packer, bucketed
from .planning._buckets import Plan
from .protocol._datagrams import Commits, Starter
from .protocol._messages import Described
from .transports import make_sender
from .transports._base import CollectiveSender, MailboxSender

__all__ = ["WeightSender"]


def _sent(begun: concurrent.futures.Future[Any], deadline: float) -> None:
    """Wait (at most until ``deadline``; the results are read later) for the wire loop to
    pick a push's members and, on the fast way, to send them the start: holding the GIL,
    this thread would keep the loop from it until its next blocking call (on four H100s
    the starts went out 0.4-0.6 ms into a push while it read its tensors and packed)."""
    concurrent.futures.wait([begun], max(0.0, deadline - time.monotonic()))
    if begun.done() and not begun.cancelled() and begun.exception() is None:
        push = begun.result()[1]
        if push is not None:
            push.told.wait(max(0.0, deadline - time.monotonic()))


class WeightSender(PushFinishing):
    """Streams named tensors to the receivers of one group, bucket by bucket.

    ``transport``: ``"shm"`` (CPU tensors, receivers on this host), ``"cuda_ipc"``
    (CUDA tensors, receivers on the same GPU) or ``"broadcast"`` (a
    ``torch.distributed`` group of the sender and its receivers: NCCL for CUDA
    tensors, gloo for CPU ones). ``receivers``: how many receivers the first
    push waits for; later pushes go to the receivers present (one that failed or
    left is dropped, one that joins is added). ``bucket_bytes``: the size of each
    of the two buffers (default: from free device memory). ``bind``: the control
    address (default: a fresh ipc:// path, or tcp://127.0.0.1 for broadcast);
    off-host binds need ``secret``. ``device``: where the buffers live (default:
    the first pushed tensor's device). ``zero_copy`` (cuda_ipc, shm): when the
    pushed tensors are contiguous and on the sender's device and the input is
    re-iterable (a ``state_dict().items()``), receivers read them where they are,
    through IPC handles (cuda_ipc) or mappings (shm) opened once while the same
    tensors are pushed again: no pack, no buffers. For shm the first such push
    moves the tensors' storages into shared memory, as ``share_memory_()`` does
    (same tensors, same values); later tensors that are not shared yet are
    packed. A generator, ``verify`` or other tensors fall back to packing.

    Two options exist for comparisons (the benchmark's rows), not for tuning:
    ``grouped_pack=False`` packs every bucket with one ``_foreach_copy_`` (per
    tensor) instead of one grouped copy for tensors pushed again at the same
    addresses (the default: one Triton launch on CUDA, one bulk host copy on
    CPU). ``nccl_high_priority=False`` (broadcast over NCCL) creates the group's
    NCCL streams, on the sender and on every receiver, at normal priority
    instead of high (the default: NCCL's kernels take SMs before the pack and
    load copies queued beside them, and the collective is what bounds a push).

    A process may run one sender per group, each with its own transport.
    """

    def __init__(
        self,
        *,
        group: str,
        transport: str = "shm",
        receivers: int = 1,
        bucket_bytes: int | None = None,
        bind: str | None = None,
        device: Any = None,
        secret: str | bytes | None = None,
        zero_copy: bool = True,
        grouped_pack: bool = True,
        nccl_high_priority: bool = True,
    ) -> None:
        self.config = SenderConfig(
            group=group,
            transport=transport,
            receivers=receivers,
            bucket_bytes=bucket_bytes,
            bind=bind,
            device=device,
            secret=secret,
            zero_copy=zero_copy,
            grouped_pack=grouped_pack,
            nccl_high_priority=nccl_high_priority,
        )
        self._loop = wire_loop()
        self._transport = tr = make_sender(
            transport, bind, secret, nccl_high_priority=nccl_high_priority
        )
        # exactly one of these is the transport: the kind decides how a push runs
        self._mailbox = tr if isinstance(tr, MailboxSender) else None
        self._collective = tr if isinstance(tr, CollectiveSender) else None
        self._hub = self._loop.run(self._make_hub())
        self._hub.on_leave = tr.receiver_left
        self._hub.on_deadline = tr.deadline_passed
        if self._collective is not None:  # broadcast with a secret: the group meets here
            self._hub.store = self._collective.kv
            self._hub.starter = Starter()
        else:
            self._hub.commits = Commits()
        bind = bind or default_address("tcp" if transport == "broadcast" else "ipc")
        self._server = Server(
            self._hub.handle, bind, secret=secret, on_disconnect=self._hub.disconnected
        )
        self.address: str = self._loop.run(self._server.start())
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._plan: Plan | None = None
        self._planned_for: Any = None  # the pairs object the plan was last checked against
        self._packer: Packer | None = None
        self._device: torch.device | None = self.config.device
        self._bucket_cap: int | None = None  # the largest default bucket (see _cap_buckets)
        self._first = True
        self._moving = False  # the push in progress got past its plan: buckets may move
        self._closed = False
        counted = ("pushes", "failed", "bytes", "plans", "lines", "here", "line")
        self._stats = dict.fromkeys(counted, 0)
        # the members of the last push, if it ended on their word on the group: the next
        # may start on their lines (see _line)
        self._committed: list[Member] | None = None
        self._lining: Push | None = None  # a push whose starts go on its members' lines
        # the members of the last push over a mailbox transport, if each committed it, and
        # the list it pushed with the tensors it let receivers read in place (see _lean)
        self._last_members: list[Member] | None = None
        self._direct_of: tuple[Any, list[torch.Tensor]] | None = None
        self._here_last = False  # the last push went that way (see _write_ahead)
        self._ahead: tuple[list[Member], list[torch.Tensor]] | None = None  # written ahead
        self._last_seconds = 0.0

    async def _make_hub(self) -> Hub:
        return Hub(self.config.group, self.config.transport)

    def _cap_ctas(self, ctas: int) -> None:
        """Let this sender's broadcast group (NCCL) take at most ``ctas`` thread blocks, at
        its end and every receiver's: a :class:`ShardedSender` bounds the memory NCCL takes
        for each of its rank's links. Used when the group next forms; other transports
        ignore it."""
        if self._collective is not None:
            self._collective.max_ctas = ctas

    def _describe_as(self, description: Described) -> None:
        """Answer a ``Describe`` of ``description.group`` with it: this sender is rank 0
        of a :class:`ShardedSender` group, and its address is the one engines are told."""

        async def set_it() -> None:
            self._hub.description = description

        self._loop.run(set_it())

    # -- the push -------------------------------------------------------------------
    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        timeout: float = 60.0,
        layout: Iterable[tuple[str, Any]] | None = None,
    ) -> PushReport:
        """Send every ``(name, tensor)`` to the group's receivers; returns when they committed.

        ``named_tensors``: a ``state_dict().items()``, a list, or a generator (one
        that gathers FSDP shards per bucket, say): tensors are packed in order
        as they come. A re-iterable input is read once for its layout first; a
        generator streams against the previous push's layout (its first push, or
        a layout change, needs ``layout=``: the names with anything that has
        ``.shape`` and ``.dtype``, else the generator is read whole first).

        A push goes to the receivers ready when it starts: the first waits for
        ``receivers`` of them, later ones for one (and for a receiver that just
        joined to ask for work, a moment at most); a receiver still busy with an
        earlier push, or one that joined and never asked for work, is left out.

        Raises:
            PushTimeout: (a ``TimeoutError``) too few receivers were ready within
                ``timeout`` (the message names each one that joined and what it was
                doing), or some did not acknowledge in time (``failures`` names them,
                ``report`` says who committed).
            WeightSyncError: a receiver rejected the plan (nothing moved) or failed
                (``failures`` names each with its reason; the others committed,
                ``report`` says who).
            SenderClosed: the sender was closed.
            ValueError: ``version`` is not an int.
        """
        return drain(self._steps(named_tensors, version, timeout, layout))

    def _steps(
        self, named: Iterable[Any] | Callable[[], tuple[list[Any], bool, Any]], version: int,
        timeout: float, layout: Iterable[tuple[str, Any]] | None = None,
    ) -> Generator[bool | None, None, PushReport]:  # fmt: skip
        """:meth:`push` as steps, for a caller that drives several senders' pushes in one
        thread (:func:`drain` runs one): the first step starts the push (a push whose
        receivers hold its plan starts streaming there), each later one packs and sends a
        bucket, the last waits for the commits; the report is the generator's value. On
        NCCL a step only enqueues work, so one thread keeps every link of a rank busy; a
        step yields True when the next one blocks (the GPU's sends, the commits), so that
        the thread enqueues the other links' buckets first (:func:`take_turns`).

        ``named`` may be a callable giving ``(named, same, guard)`` once the push started
        (the caller's tensors are made ready while the receivers get the start); ``same``:
        the list object pushed last, whose tensors the caller checked are the same (same
        memory, same layout), so their checks are skipped; ``guard``: None, or called with
        each bucket's tensor indices and list before the bucket is packed, to replace
        tensors of it (in the list, and in ``named``) that the caller finds stale then
        (it returns their indices). Such a caller must push the
        layout of the last push (a push that started streaming the old one fails, aborted)."""
        if type(version) is not int:
            raise RequestError(f"push.version: expected an int, got {version!r}")
        if self._closed:
            raise SenderClosed(
                f"push of version {version}: the sender of group {self.config.group!r} is "
                "closed (make a new WeightSender)"
            )
        with self._lock:
            kept = self._plan, self._planned_for, self._packer, self._device
            self._moving = False
            try:
                return (yield from self._push(named, version, timeout, layout))
            except BaseException as e:
                if not self._moving:  # it failed before any bucket moved: it leaves nothing
                    self._plan, self._planned_for, self._packer, self._device = kept
                    if self._mailbox is not None:
                        self._mailbox.abandon()
                if isinstance(e, WeightSyncError):
                    self._stats["failed"] += 1
                raise

    def _push(
        self,
        named: Iterable[Any] | Callable[[], tuple[list[Any], bool, Any]],
        version: int,
        timeout: float,
        layout: Iterable[tuple[str, Any]] | None,
    ) -> Generator[bool | None, None, PushReport]:
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        seq = next(self._seq)
        wait_for = self.config.receivers if self._first else 1
        last, self._last_members = self._last_members, None
        ahead, self._ahead = self._ahead, None
        self._here_last = False
        if callable(named) and not self._first:
            members = ahead[0] if ahead is not None else self._lean(last)
            if members is not None:  # the caller's tensors are read first: no loop to wait for
                given = named()
                kept = self._kept_direct(*given)
                if kept is not None and (ahead is None or ahead[1] is kept):
                    return (yield from self._push_here(
                        members, kept, given[0], seq, version, t0, deadline, ahead is not None
                    ))  # fmt: skip
                named = lambda: given  # noqa: E731  (the usual way, with what it gave)
        run = self._loop.run
        args = {"seq": seq, "version": version, "timeout": timeout}
        begun: concurrent.futures.Future[tuple[list[Member], Push | None]] | None = None
        fast = early = None
        lined = False  # started on the members' lines (see _begin)
        buckets: Iterator[tuple[int, list[Any]]] | None = None
        same, guard = False, None
        try:  # until the members are known: a push the hub started is aborted, not left
            if callable(named):
                early = self._plan
                if not self._first and early is not None:
                    fast = self._fast(early, seq, version)
                    begun, lined = self._begin(fast, args, wait_for, deadline)
                    yield False  # the caller's other pushes start too
                    if not lined:  # the receivers get the start while tensors are read
                        _sent(begun, deadline)
                named, same, guard = named()
            if same and self._plan is not None and named is self._planned_for:
                plan, checked = self._plan, False
            else:
                same = False
                named, plan, checked = self._layout(named, layout)
            if guard is not None:
                buckets = self._guarded(bucketed(plan, named, checked), guard, plan)
            if begun is None:
                fast = self._fast(plan, seq, version) if not self._first else None
                begun, lined = self._begin(fast, args, wait_for, deadline)
                if fast is not None and not lined:
                    _sent(begun, deadline)  # the receivers get the start while bucket 0 packs
            elif plan is not early:
                fast = None
                if begun.result()[1] is not None:  # a started stream carries the old plan
                    raise WeightSyncError("the layout changed after the push started (a bug)")
            if fast is not None:  # bucket 0 is packed while the loop picks the members
                assert self._packer is not None
                self._packer.same = same
                rest = buckets or bucketed(plan, named, checked)
                first = next(rest)
                self._packer.pack(*first)
                buckets = itertools.chain([first], rest)
            members, push = begun.result()
            if push is not None and push.direct:
                self._lines_started(push)
        except BaseException as e:
            self._abandon(begun, e, deadline, seq, lined)
        self._first = False
        mail, coll = self._mailbox, self._collective
        if push is not None:  # the members hold the plan and the group: streaming already
            self._moving = True
            return (yield from self._finish(
                push, plan, named, checked, t0, deadline, buckets, packed=True
            ))  # fmt: skip
        plan_sent = any(m.plan != plan.fingerprint for m in members)
        verify = any(m.verify for m in members)
        direct: list[torch.Tensor] | None = None
        if self.config.zero_copy and mail is not None and not checked and not verify:
            assert self._device is not None
            direct = [t for _, t in named]
            if not mail.use_direct(direct, self._device):
                named = iter([(s.name, t) for s, t in zip(plan.specs, direct, strict=True)])
                direct = None
        if direct is None and mail is not None:
            mail.use_packed()
        self._direct_of = (named, direct) if direct is not None else None
        setups = self._setups(members, plan, timeout)
        push = Push(
            seq, version, plan.to_wire() if plan_sent else None, plan.fingerprint, members,
            setups, coll is not None, verify,
        )  # fmt: skip
        if not setups:  # every member holds the plan and the buffers: stream at once
            self._moving = True
        if self._packer is not None:
            self._packer.same = same
        try:  # interrupted, the start ran on the loop or never will: either way, aborted
            run(self._hub.start(push, streaming=not setups))
        except BaseException as e:
            self._fail(e, push, deadline)
        if setups:
            try:
                if coll is not None:
                    coll.form(deadline)
                rejected = run(self._hub.planned(deadline))
                if rejected:
                    raise error_class(rejected)(
                        f"push of version {version}: {self._failures_text(rejected)}; no "
                        "bucket moved",
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
                run(self._hub.stream())
            except BaseException as e:
                self._fail(e, push, deadline)
        return (yield from self._finish(
            push, plan, named, checked, t0, deadline, buckets, direct=direct
        ))  # fmt: skip

    def _push_here(
        self, members: list[Member], direct: list[torch.Tensor], named: Any, seq: int,
        version: int, t0: float, deadline: float, written: bool,
    ) -> Generator[bool | None, None, PushReport]:  # fmt: skip
        """A push of :meth:`_lean`'s members, started by this thread: the hub takes part
        (a callback, not waited for), the tensors are made ready (written into receivers
        that offered theirs; ``written``: already, see :meth:`_write_ahead`), then every
        bucket is announced, each member's parked request answered once. Given up before
        the hub took part, it is registered and aborted all the same (see
        :meth:`_abandon`): its receivers may have been written."""
        plan = self._plan
        assert plan is not None
        push = Push(seq, version, None, plan.fingerprint, members, {}, False, False)
        self._lining = push
        try:
            self._loop.loop.call_soon_threadsafe(self._hub.take_part, push, deadline)
        except BaseException as e:
            self._abandon(None, e, deadline, seq, lined=True)
        self._moving = self._here_last = True
        self._stats["here"] += 1
        return (yield from self._finish(
            push, plan, named, False, t0, deadline, direct=direct, written=written
        ))  # fmt: skip

    def _guarded(
        self, buckets: Iterator[tuple[int, list[Any]]], guard: Callable[..., list[int]],
        plan: Plan,
    ) -> Iterator[tuple[int, list[Any]]]:  # fmt: skip
        """``buckets``, ``guard`` asked before each is packed (see :meth:`_steps`); the
        buckets of the tensors it replaced are packed anew (grouped copies built again)."""
        per = plan.order[0]
        for k, tensors in buckets:
            replaced = guard(per[k], tensors)
            if replaced and self._packer is not None:
                self._packer.forget(replaced)
            yield k, tensors

    # -- the rest ---------------------------------------------------------------------
    def statistics(self) -> SenderStatistics:
        return SenderStatistics(
            group=self.config.group,
            transport=self.config.transport,
            address=self.address,
            receivers=sum(not m.gone for m in self._hub.members.values()),
            pushes=self._stats["pushes"],
            failed_pushes=self._stats["failed"],
            bytes_pushed=self._stats["bytes"],
            last_push_seconds=self._last_seconds,
            bucket_bytes=self._plan.bucket_bytes if self._plan else self.config.bucket_bytes or 0,
            buffer_bytes=self._transport.buffer_bytes,
            plans_sent=self._stats["plans"],
            groups_formed=self._transport.groups_formed,
            started_on_lines=self._stats["lines"],
            started_here=self._stats["here"],
            commits_on_line=self._stats["line"],
        )

    def close(self) -> None:
        """Stop serving; receivers see the sender gone and keep their last version."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._loop.run(self._server.close())
            self._transport.close()
            if self._hub.starter is not None:
                self._hub.starter.close()
            if self._hub.commits is not None:
                self._hub.commits.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
