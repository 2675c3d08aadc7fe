"""A receiver's handling of a push's messages: its plan and buffers (``Setup``), its
buckets (a mailbox's ``Bucket``, or a collective's ``Stream``), the loads, the commit;
each answered with the ``Ack`` the receiver sends back. :class:`WeightReceiver` keeps
the connection, the serving loop and the waiters, and owns a :class:`Loader`."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from rlferry.wire import Client, RemoteError, SecurityError, WireError

from .._config import ReceiverConfig
from .._errors import WeightSyncError
from ..copies._pack import Unpacker
from ..delta._applying import Receiving
from ..planning._buckets import Plan
from ..planning._specs import check_against
from ..protocol._messages import (
    ABORTED,
    DONE,
    IDLE,
    PLAN,
    Abort,
    Ack,
    Bucket,
    Setup,
    StoreOp,
    StoreReply,
    Stream,
    decode_reply,
    encode,
)
from ..transports._base import CollectiveReceiver, MailboxReceiver, checksum
from ._watch import StreamWatch

__all__ = ["Loader", "ReceiverCounts"]

log = logging.getLogger("rlferry.weights")


def _host_of(address: str) -> str:
    rest = address.partition("://")[2]
    host = rest.rpartition(":")[0] if address.startswith("tcp://") else ""
    return host.strip("[]") if host and host not in ("*", "0.0.0.0") else "127.0.0.1"


@dataclass
class ReceiverCounts:
    """What a receiver did so far (see ``ReceiverStatistics``)."""

    commits: int = 0
    failures: int = 0
    bytes: int = 0  # loaded
    written: int = 0  # written into this receiver's tensors by its sender
    last_seconds: float = 0.0
    last_error: str | None = None


class Loader:
    """One receiver's handling of the pushes' messages, and what it holds between them:
    the plan, the buffers and their unpacker. ``committed(version)`` is called once a
    version is whole here; ``targets``, if set, gives where each tensor of a plan goes in
    the receiver's own tensors (a :class:`ShardedReceiver`'s, offered to a cuda_ipc sender
    to write into)."""

    def __init__(
        self, config: ReceiverConfig, name: str, watch: StreamWatch, counts: ReceiverCounts,
        committed: Callable[[int], None],
    ) -> None:  # fmt: skip
        self.config = config
        self.name = name
        self.counts = counts
        self._watch = watch
        self._committed = committed
        self._client: Client | None = None
        self._mailbox: MailboxReceiver | None = None  # the transport, if a mailbox
        self._collective: CollectiveReceiver | None = None  # the transport, if a collective
        self._key = b""  # the receiver's key at the sender (Welcome's)
        self.targets: Callable[[Plan], Any] | None = None
        self._written = False  # the sender took the targets: it writes into them
        self.seen = 0  # the last push it got a message of (a start after it is stale)
        self.prefetch: bytes | None = None  # the request that asked for the next bucket
        self.pushing: int | None = None  # the version of the push in progress, or last seen
        self._broke: str | None = None  # why the stream just handled broke, not yet told
        self._plan: Plan | None = None
        self._unpacker: Unpacker | None = None
        self._bufs: list[torch.Tensor] = []
        self._push_start = 0.0
        self.deltas = Receiving(config.deltas, config.delta_base)

    def connect(
        self, client: Client, mailbox: MailboxReceiver | None,
        collective: CollectiveReceiver | None,
    ) -> None:  # fmt: skip
        """The receiver's socket to its sender, and its transport (exactly one kind)."""
        self._client, self._mailbox, self._collective = client, mailbox, collective

    def joined(self, key: bytes) -> None:
        """The receiver (re)joined its sender under ``key``: that sender's pushes count
        from 1."""
        self._key, self.seen = key, 0

    def take_broke(self) -> str | None:
        """Why the stream just handled broke (see :meth:`WeightReceiver._heard`), once."""
        broke, self._broke = self._broke, None
        return broke

    def tell_failure(self, reason: str, final: bool = False) -> None:
        if self.config.on_failure is not None:
            try:
                self.config.on_failure(reason, final)
            except Exception as e:  # the receiver goes on: its own ack carries the failure
                log.warning("receiver %s: on_failure raised %s: %s", self.name, type(e).__name__, e)

    def send(self, ack: Ack) -> bytes:
        assert self._client is not None
        return self._client.send(encode(self._stamped(ack)))

    def _stamped(self, ack: Ack) -> Ack:
        """``ack`` telling the version this receiver holds whole (see ``Ack.holds``)."""
        holds = self.deltas.holds
        return msgspec.structs.replace(ack, holds=-1 if holds is None else holds)

    def _ask_ahead(self, ack: Ack) -> None:
        """Ask for the next bucket now (it comes while this one loads); if the ask cannot
        go, the serving loop's next send meets the same error."""
        try:
            self.prefetch = self.send(ack)
        except (WireError, RemoteError, SecurityError) as e:
            log.debug("receiver %s: the next bucket was not asked for: %s", self.name, e)

    def handle(self, msg: Any) -> Ack:
        """Handle one message of a push; the acknowledgement to send back."""
        return self._stamped(self._handle(msg))

    def _handle(self, msg: Any) -> Ack:
        self.prefetch = None
        if isinstance(msg, (Setup, Bucket, Stream, Abort)):
            self.seen = max(self.seen, msg.seq)  # a start on the line up to it is stale
            if msg.version >= 0:
                self.pushing = msg.version
            self.deltas.message(msg.seq)
        try:
            if isinstance(msg, Setup):
                return self._setup(msg)
            if isinstance(msg, Bucket):
                return self._bucket(msg)
            if isinstance(msg, Stream):
                return self._stream(msg)
            if isinstance(msg, Abort):
                return self._dropped(msg.seq, f"the sender aborted the push: {msg.reason}")
            return Ack(0, IDLE)
        except Exception as e:
            seq = msg.seq if isinstance(msg, (Setup, Bucket, Stream, Abort)) else 0
            step = msg.index if isinstance(msg, Bucket) else PLAN if isinstance(msg, Setup) else 0
            return self._failed(seq, step, f"{type(e).__name__}: {e}")

    def _failed(self, seq: int, step: int, reason: str, broke: bool = False) -> Ack:
        """A failure of this push here; ``broke``: its stream broke (see :meth:`_heard`)."""
        self.counts.failures += 1
        self.counts.last_error = reason
        log.warning("receiver %s: %s", self.name, reason)
        if broke:
            self._broke = reason
        else:
            self.tell_failure(reason)
        return Ack(seq, step, error=reason)

    def _dropped(self, seq: int, why: str, broke: bool = False) -> Ack:
        self._push_start = 0.0
        if broke:
            self._broke = why
        else:
            self.tell_failure(why)
        return Ack(seq, ABORTED)

    def _setup(self, msg: Setup) -> Ack:
        self._push_start = time.perf_counter()
        if "same" in msg.plan:
            if self._plan is None or self._plan.fingerprint != msg.plan["same"]:
                raise WeightSyncError("the sender assumed a plan this receiver does not hold")
            plan = self._plan
        else:
            plan = Plan.from_wire(msg.plan)
        why: str | None
        try:
            specs = self.deltas.setup(msg.delta, plan)
        except WeightSyncError as e:
            why, what = str(e), "refused the delta push"
        else:  # a delta is checked as the tensors it updates
            seen = plan if specs is None else dataclasses.replace(plan, specs=tuple(specs))
            why, what = check_against(seen, self.config.expected), "rejected the plan"
        handles: list[bytes] = []
        coll, mail = self._collective, self._mailbox
        if why is not None:
            # a group is formed once every member joined it: one that rejects the plan
            # joins all the same, so that the sender hears the rejection at once (else it
            # waited for it to join until the push's timeout, and named only the others)
            if coll is not None:
                coll.join(msg.transport, _host_of(self.config.address), self.config.device,
                          self._store_call)  # fmt: skip
            return self._failed(msg.seq, PLAN, f"{what}: {why}")
        if coll is not None:
            host = _host_of(self.config.address)
            coll.join(msg.transport, host, self.config.device, self._store_call)
            bufs = coll.buffers(plan.buffer_bytes)
        else:
            assert mail is not None
            handles = mail.attach(msg.transport, self.config.device)
            if mail.direct:  # zero copy: reading the sender's tensors, or written into ours
                bufs = list(mail.tensors)
                self._unpacker = Unpacker.direct(plan, bufs, mail.strides)
                self._bufs, self._plan = bufs, plan
                targets = self.targets(plan) if self.targets is not None else None
                offered = mail.offer(targets) if targets is not None else None
                self._written = offered is not None
                if self._written:  # the sender writes into our tensors from now on
                    self.deltas.written()
                return Ack(msg.seq, PLAN, handles=handles, targets=offered)
            self._written = False
            bufs = [mail.buffer(0), mail.buffer(1)]
        same = len(bufs) == len(self._bufs) and all(
            a is b for a, b in zip(bufs, self._bufs, strict=True)
        )
        if self._unpacker is None or self._unpacker.plan is not plan or not same:
            self._unpacker = Unpacker(plan, bufs)
            self._bufs = bufs
        self._plan = plan
        return Ack(msg.seq, PLAN, handles=handles)

    def _store_call(self, op: StoreOp) -> StoreReply:
        """One rendezvous store operation, sent to the sender over the control channel."""
        assert self._client is not None
        try:
            reply = decode_reply(self._client.request(encode(op), op.timeout + 10))
        except (WireError, RemoteError, SecurityError) as e:
            raise WeightSyncError(f"the sender did not answer a store request: {e}") from None
        if not isinstance(reply, StoreReply):
            raise WeightSyncError(
                f"store request: expected a StoreReply, got {type(reply).__name__}"
            )
        return reply

    def _load(self, k: int) -> None:
        u = self._unpacker
        assert u is not None
        u.stage(k)
        items: list[Any] = self.deltas.items(u.loads[k]) if u.loads[k] else []
        rest = self.deltas.last() if k + 1 == u.plan.buckets else []
        if rest:  # a ``whole`` receiver's delta push: every tensor, once the last bucket came
            items = [*items, *rest]
        if items:
            self.config.load(items)
        self.counts.bytes += u.bytes[k]

    def _bucket(self, msg: Bucket) -> Ack:
        plan, u = self._plan, self._unpacker
        if plan is None or u is None:
            raise WeightSyncError("a bucket came before the plan")
        first, last = msg.index, max(msg.index, msg.last)
        if first == 0 and self._push_start == 0.0:
            self._push_start = time.perf_counter()
        if last + 1 < plan.buckets:  # ask for the next bucket now: it comes while these load
            self._ask_ahead(Ack(msg.seq, first - 1, want=last + 1))
        for k in range(first, last + 1):
            failed = self._load_bucket(msg, k)
            if failed is not None:
                return failed
        if last + 1 < plan.buckets:
            return Ack(msg.seq, last)
        assert self._mailbox is not None
        self._mailbox.finish()
        return self._commit(msg.seq, msg.version)

    def _load_bucket(self, msg: Bucket, k: int) -> Ack | None:
        """Load bucket ``k`` of a mailbox transport; a failure's Ack, or None."""
        plan, tr = self._plan, self._mailbox
        assert plan is not None and tr is not None
        b = k % 2
        tr.before_load(b)
        stream = tr.load_stream
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            if msg.checksum is not None and self.config.verify:
                got = checksum(tr.buffer(b)[: plan.bucket_used[k]])
                if got != msg.checksum:
                    return self._failed(
                        msg.seq, k, f"checksum mismatch in bucket {k} (the data arrived corrupt)"
                    )
            try:
                if self._written:  # the sender wrote this push into our tensors
                    assert self._unpacker is not None
                    self.counts.written += self._unpacker.bytes[k]
                else:
                    self._load(k)
            except Exception as e:
                return self._failed(
                    msg.seq, k, f"load raised {type(e).__name__}: {e} (at bucket {k} of "
                    f"{plan.buckets}, version {msg.version})",
                )  # fmt: skip
        tr.after_load(b)
        return None

    def _stream(self, msg: Stream) -> Ack:
        plan = self._plan
        if plan is None:
            raise WeightSyncError("a stream came before the plan")
        if self._push_start == 0.0:
            self._push_start = time.perf_counter()

        def on_bucket(k: int, buf: torch.Tensor) -> None:
            self._load(k)

        coll = self._collective
        assert coll is not None
        abort = coll.aborter()
        if abort is not None:  # the watch ends it if the sender aborts it (it waits deaf)
            self._watch.arm(self._key)
            why = self._watch.streaming(msg.seq, abort)
            if why is not None:
                return self._dropped(msg.seq, why)
        error = coll.stream(plan, on_bucket, msg.verify)
        why = self._watch.streamed() if abort is not None else None
        if why is not None:
            coll.leave()
            return self._dropped(msg.seq, why, broke=True)
        if error is not None:
            coll.tell(False)
            return self._failed(msg.seq, 0, f"{error}, version {msg.version}", broke=True)
        ack = self._commit(msg.seq, msg.version)
        # said on the group before the ack goes: the sender's push ends on it (told after
        # the ack, its end comes 1.0-1.3 ms after the commit, not 0.45-0.55: ``python
        # benchmarks/weights_sharded.py --device cuda --transport broadcast --point-to-point
        # --senders 2 --receivers 2 --scale 2 --trace DIR`` on four H100s)
        coll.tell(ack.step == DONE)
        return ack

    def _commit(self, seq: int, version: int) -> Ack:
        if self.config.on_commit is not None:
            try:
                self.config.on_commit(version)
            except Exception as e:
                return self._failed(seq, DONE - 1, f"on_commit raised {type(e).__name__}: {e}")
        self._committed(version)
        self.deltas.committed(version)
        self.counts.commits += 1
        self.counts.last_seconds = time.perf_counter() - self._push_start
        self._push_start = 0.0
        return Ack(seq, DONE)
