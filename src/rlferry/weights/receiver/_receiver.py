"""The receiver: joins a sender's group, loads every bucket, commits whole versions."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlferry.wire import ChannelClosed, PeerGone, RemoteError

from .._config import ReceiverConfig
from .._errors import ReceiverClosed, SenderGone, WeightSyncError
from .._report import ReceiverStatistics
from ..planning._buckets import Plan
from ..planning._specs import TensorSpec
from ..protocol._messages import (
    ABORTED,
    DONE,
    IDLE,
    Abort,
    Ack,
    Bucket,
    Stream,
    Welcome,
    decode_reply,
)
from ..transports import make_receiver
from ..transports._base import CollectiveReceiver, MailboxReceiver, ReceiverTransport
from ._connection import Connection
from ._loading import Loader, ReceiverCounts
from ._watch import StreamWatch

__all__ = ["WeightReceiver", "link_receiver"]

log = logging.getLogger("rlferry.weights")
_names = itertools.count()


class WeightReceiver:
    """Receives the pushes of one sender's group and hands each bucket to ``load``.

    ``load(items)`` gets a list of ``(name, tensor)`` and must copy them into the
    engine's parameters before returning, never write them (the tensors are
    views of a buffer that the next bucket overwrites, or with cuda_ipc zero
    copy of the trainer's own tensors; on CUDA the copies may be queued on the
    current stream, which rlferry waits for before the commit). ``version`` is
    the last version whose every bucket was loaded and whose ``on_commit``
    returned. ``expected`` (names to tensors, or a callable that raises on a
    bad list of specs) validates the layout before any bucket moves.
    ``verify`` checks a checksum of every bucket. ``device``: for broadcast, the
    GPU of this receiver's buffers (default: the current CUDA device for NCCL).
    ``on_failure(reason, final)`` is called, on the receiver's thread, when a push
    fails here or its sender aborts it (``final`` False), and when the receiver
    stops serving (``final`` True): a caller that waits on pushes in a thread of
    its own (an engine's update call) learns it at once, not at its timeout.

    End of life: :meth:`close` (the sender sees the receiver leave; a later
    :meth:`wait_for` for a version it does not hold raises ``ReceiverClosed``). A
    sender that goes away ends the serving and leaves the receiver at its last
    version: ``wait_for`` raises ``SenderGone``; join the next sender with a new
    receiver. A background thread that fails (a reply it cannot read, a bug)
    makes ``wait_for`` raise ``WeightSyncError`` naming the failure. In each case
    ``statistics().stopped`` says why the receiver serves no more.

    Delta pushes (from a sender with ``delta_budget``): ``deltas="in_place"`` lets
    ``load`` get ``(name, Delta)`` items, each to apply to the engine's tensor of that
    name, which holds the last committed version (``Delta.apply_``; ``ParamLoader`` does
    it); ``deltas="base"`` keeps a copy of the last committed version (in host memory,
    pinned for CUDA tensors, or ``delta_base="device"``: on the pushed tensors' device)
    and hands ``load`` the whole tensors a delta changed, rebuilt from it;
    ``deltas="whole"`` keeps the same copy and hands ``load`` every tensor of a delta
    push's version once its last bucket came (a loader that reloads a layer only from
    all of its tensors, as vLLM's layerwise reload). None (the default): the sender
    never sends this receiver a delta. A delta whose base version
    this receiver does not hold is refused before any byte moves (the sender raises
    ``DeltaBaseMissing``); after a push that failed here it holds no whole version, and
    its next push is full.
    """

    def __init__(
        self,
        *,
        group: str,
        address: str,
        load: Callable[[list[tuple[str, torch.Tensor]]], Any],
        device: Any = None,
        on_commit: Callable[[int], Any] | None = None,
        on_failure: Callable[[str, bool], Any] | None = None,
        expected: Mapping[str, Any] | Callable[[list[TensorSpec]], None] | None = None,
        verify: bool = False,
        name: str | None = None,
        secret: str | bytes | None = None,
        deltas: str | None = None,
        delta_base: str = "host",
    ) -> None:
        self.config = ReceiverConfig(
            group=group,
            address=address,
            load=load,
            device=device,
            on_commit=on_commit,
            on_failure=on_failure,
            expected=expected,
            verify=verify,
            name=name,
            secret=secret,
            deltas=deltas,
            delta_base=delta_base,
        )
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{next(_names)}"
        self._transport: ReceiverTransport | None = None
        self._collective: CollectiveReceiver | None = None  # the transport, if a collective
        self._conn = Connection(self.config, self.name)
        self._lined = 0  # the last push started on the start line that it settled
        self._watch = StreamWatch(address, secret, self.name)
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._version: int | None = None
        # a commit's waiters are woken once its acknowledgement went (see _wake); the hook
        # runs then too (a ShardedReceiver's, whose waiters wait on the whole version)
        self._unwoken = False
        self._after_ack: Callable[[], None] | None = None
        self._closed = False
        self._counts = ReceiverCounts()
        self._loader = Loader(self.config, self.name, self._watch, self._counts, self._committed)
        self._stopped: tuple[type[WeightSyncError], str] | None = None  # why it serves no more

    # -- life ---------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> WeightReceiver:
        """Join the sender's group (raises here if it refuses) and serve in the background.

        Raises:
            SenderGone: no sender at the address, or none answered within ``timeout``.
            ReceiverClosed: this receiver was closed.
            WeightSyncError: the sender refused (wrong group or transport).
        """
        if self._closed:
            raise ReceiverClosed(
                f"receiver `{self.name}` is closed (make a new WeightReceiver to join again)"
            )
        if self._thread is not None:
            raise WeightSyncError(f"receiver `{self.name}` is already started")
        welcome = self._conn.open(timeout)
        self._joined(welcome)
        tr = self._transport = make_receiver(welcome.transport)
        self._collective = tr if isinstance(tr, CollectiveReceiver) else None
        mailbox = tr if isinstance(tr, MailboxReceiver) else None
        assert self._conn.client is not None
        self._loader.connect(self._conn.client, mailbox, self._collective)
        self._thread = threading.Thread(
            target=self._serve, name=f"rlferry-weights-{self.name}", daemon=True
        )
        self._thread.start()
        return self

    def _joined(self, welcome: Welcome) -> None:
        self._loader.joined(welcome.key)
        self._lined = 0  # this sender's pushes count from 1

    @property
    def version(self) -> int | None:
        """The last version committed, or None before the first."""
        return self._version

    @property
    def pushing(self) -> int | None:
        """The version of the push in progress, or of the last one seen (None before)."""
        return self._loader.pushing

    @property
    def collective(self) -> bool:
        """Whether the buckets come by a collective (NCCL or gloo broadcast): a load's
        copies then run beside the collective of the next bucket, and should leave it its
        SMs (False before the first push brings the transport)."""
        return self._collective is not None

    def wait_for(self, version: int, timeout: float | None = None) -> bool:
        """Block until ``self.version >= version``; False if ``timeout`` ran out first.

        Raises (at once, not at the timeout), when the version can no longer come:
            ReceiverClosed: the receiver was closed.
            SenderGone: the sender went away (closed or died).
            WeightSyncError: the receiver's thread failed (the message says how).
        """

        def reached() -> bool:
            return self._version is not None and self._version >= version

        with self._cond:
            self._cond.wait_for(lambda: reached() or self._stopped is not None, timeout)
            if reached():
                return True
            if self._stopped is not None:
                cls, why = self._stopped
                raise cls(f"receiver `{self.name}` cannot reach version {version}: {why}")
            return False

    def _stop(self, cls: type[WeightSyncError], why: str, then: str = "") -> None:
        """The receiver serves no more, because ``why``: every waiter learns it now, and
        ``then`` (what it holds and what to do, for this receiver's own users; its
        ``on_failure``, a :class:`ShardedReceiver`'s or an engine's, gets ``why``)."""
        with self._cond:
            first = self._stopped is None
            if first:
                self._stopped = (cls, why + then)
            self._cond.notify_all()
        if first:
            self._loader.tell_failure(why, final=True)

    def close(self) -> None:
        """Leave the group; a push in progress sees this receiver gone."""
        if self._closed:
            return
        self._closed = True
        self._stop(ReceiverClosed, f"it is closed (at version {self._version})")
        self._watch.close()
        self._conn.leave()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30)
        if self._transport is not None:
            self._transport.close()
        if self._thread is None or not self._thread.is_alive():
            self._conn.close_lines()

    def __enter__(self) -> WeightReceiver:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statistics(self) -> ReceiverStatistics:
        t, c = self._transport, self._counts
        return ReceiverStatistics(
            group=self.config.group,
            name=self.name,
            version=self._version,
            commits=c.commits,
            failures=c.failures,
            bytes_loaded=c.bytes,
            bytes_written=c.written,
            last_push_seconds=c.last_seconds,
            buffers_opened=t.opened if t is not None else 0,
            groups_joined=t.groups_joined if t is not None else 0,
            last_error=c.last_error,
            stopped=self._stopped[1] if self._stopped is not None else None,
            buffer_bytes=t.buffer_bytes if t is not None else 0,
        )

    # -- the loop -----------------------------------------------------------------
    def _committed(self, version: int) -> None:
        """Version ``version`` is whole here (the loader's commit, on the serving thread)."""
        with self._cond:
            self._version = version  # read at once; waiters are woken once the ack went
        self._unwoken = True

    def _wake(self) -> None:
        """Wake the waiters of the version just committed, after its acknowledgement went:
        a waiting thread woken first takes the GIL from the one sending it (the
        acknowledgement goes 0.1-0.2 ms later so, on four H100s and on the CPU)."""
        if not self._unwoken:
            return
        self._unwoken = False
        with self._cond:
            self._cond.notify_all()
        if self._after_ack is not None:
            self._after_ack()

    def _serve(self) -> None:
        """The background thread: serve until stopped, then say why to every waiter."""
        try:
            stopped = self._serve_pushes()
            self._wake()  # a commit whose acknowledgement could not go
        except BaseException as e:  # a reply it cannot read, or a bug: never hide it
            log.exception("receiver %s: its thread failed", self.name)
            stopped = (
                WeightSyncError,
                f"its thread failed: {type(e).__name__}: {e} (a sender of another rlferry "
                "version, or a bug: please report it)",
                f"; this receiver stays at version {self._version}",
            )
        if stopped is not None:
            self._counts.last_error = stopped[1]
            self._stop(*stopped)

    def _serve_pushes(self) -> tuple[type[WeightSyncError], str, str] | None:
        """Serve every push; why it stopped (None: it was closed)."""
        dev = self.config.device
        if dev is not None and dev.type == "cuda":
            torch.cuda.set_device(dev)
        conn = self._conn
        ask: Ack | None = Ack(0, IDLE)  # the next request to send (None: ``rid`` is sent)
        rid = b""
        while not self._closed:
            try:
                if ask is not None:
                    rid, ask = self._loader.send(ask), None
                    self._wake()
                reply = conn.wait(rid)
                msg = decode_reply(reply) if reply is not None else None
            except ChannelClosed:
                return None
            except PeerGone as e:
                return self._gone(e)
            except RemoteError as e:  # the sender forgot us (it saw us disconnect): join again
                log.info("receiver %s: %s; joining again", self.name, e.message)
                try:
                    self._joined(conn.join(30.0))
                except WeightSyncError as e2:
                    return type(e2), f"the sender dropped it and it could not join again: {e2}", ""
                ask = Ack(0, IDLE)
                continue
            lined = msg is None
            if msg is None:  # its start line: the request stays parked
                msg = conn.take_start()
                if msg is None or msg.seq <= self._loader.seen:
                    continue  # a probe, a stray, or the start of a push already aborted
            elif isinstance(msg, Abort) and msg.seq == self._lined:
                # a push started on its line, settled here (its ack is on its way): it is
                # dropped for the sender's sake, and not told again to on_failure
                ask = Ack(msg.seq, ABORTED)
                continue
            ack = self._loader.handle(msg)
            if ack.step == DONE:  # said first where it is awaited
                conn.say_committed(ack.seq)
            if lined:
                assert isinstance(msg, (Stream, Bucket))
                self._lined = msg.seq
            broke = self._loader.take_broke()
            if broke is not None:
                try:
                    self._heard(ack, broke)
                except PeerGone as e:
                    return self._gone(e, f" while it pushed version {self.pushing}: {broke}")
                except ChannelClosed:
                    return None
                if lined:  # told unparked: the request stays parked
                    continue
            elif lined:  # told unparked: the request stays parked
                conn.note(ack)
                self._wake()
                continue
            if self._loader.prefetch is not None:  # the next bucket is already asked for
                conn.note(ack)
                self._wake()
                rid = self._loader.prefetch
            else:
                ask = ack
        return None

    def _gone(self, e: PeerGone, detail: str = "") -> tuple[type[WeightSyncError], str, str]:
        log.info("receiver %s: %s; it stays at version %s", self.name, e, self._version)
        return (
            SenderGone,
            f"the sender at {self.config.address} went away (it closed or died){detail}",
            f"; this receiver stays at version {self._version} (join the next sender with a "
            "new WeightReceiver)",
        )

    def _heard(self, ack: Ack, broke: str) -> None:
        """A stream that broke (its collective failed, or was aborted): whether because
        the sender went away. Its process died in the stream as likely as any other
        fault, and the collective's error says only that a connection broke: the sender
        is told now, and answers at once (unparked) if it is there; then the failure is
        told as this push's (``on_failure``, not final). Raises ``PeerGone`` if it went
        away (the receiver stops: a final failure naming the sender)."""
        self._conn.heard(ack)
        self._loader.tell_failure(broke)


def link_receiver(
    *, after_ack: Callable[[], None], targets: Callable[[Plan], Any] | None, **kwargs: Any
) -> WeightReceiver:
    """A :class:`WeightReceiver` (``kwargs``) of one link of a :class:`ShardedReceiver`:
    ``after_ack`` runs once each commit's acknowledgement went (the sharded receiver's
    waiters wait on the whole version); ``targets``, if given, where each tensor of a
    plan goes in the engine rank's own tensors, offered to a cuda_ipc sender to write
    there (None: this receiver loads, through its ``load``)."""
    r = WeightReceiver(**kwargs)
    r._after_ack = after_ack
    r._loader.targets = targets
    return r
