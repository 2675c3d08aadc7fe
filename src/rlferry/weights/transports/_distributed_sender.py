"""The ``broadcast`` transport's sender: a ``torch.distributed`` group of the sender (rank 0)
and its receivers, one broadcast per bucket (a group of two for a point-to-point link).

rlferry forms the group itself, over a rendezvous store that only the group's
peers reach (``_rendezvous``: a TCPStore bound to the control bind's loopback
host, or, when the sender has a secret, a store served over the authenticated
control channel). No global ``torch.distributed`` state is touched: the user's
own default group, if any, is left alone. NCCL for CUDA buffers, gloo for CPU
ones; gloo's own sockets listen on the host that faces the peers (loopback for
a loopback sender). The group is formed when the set of receivers changes (or
after a failure broke it) and reused by every push in between.

Pipelining, on both sides, with two buffers: the sender packs bucket k+1 while
bucket k is in flight; each receiver posts the broadcast of bucket k+1 before
loading bucket k. On CUDA every wait is a stream wait (the collectives run on
NCCL's own stream, the loads on the receiver's load stream), so no CPU waits
for the GPU until the receiver's commit.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Generator, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlferry.wire import wire_loop

from .._errors import PushTimeout, WeightSyncError
from ..copies._copy import load_kernels
from ..planning._buckets import Plan
from ._base import CollectiveSender, checksum
from ._groups import (
    COMMITTED,
    abort,
    broadcast_options,
    first_line,
    make_group,
    max_options,
    release,
    settled,
    wait,
)
from ._rendezvous import CallStore, KeyValue, loopback_store

__all__ = ["DistributedSender"]

log = logging.getLogger("rlferry.weights")
_epochs = itertools.count(1)


def _bind_host(bind: str | None) -> str:
    """The host of a control bind: tcp://HOST:PORT's HOST, 127.0.0.1 for ipc:// or none."""
    if bind is None or not bind.startswith("tcp://"):
        return "127.0.0.1"
    host = bind[len("tcp://") :].rpartition(":")[0].strip("[]")
    return "127.0.0.1" if host == "localhost" else host


class DistributedSender(CollectiveSender):
    name = "broadcast"
    collective = True

    def __init__(
        self, bind: str | None, secret: str | bytes | None, *, high_priority: bool = True
    ) -> None:
        host = _bind_host(bind)
        # With a secret the group meets over the authenticated control channel (the hub
        # serves ``kv``); without, the control bind is loopback (the wire refuses
        # otherwise) and so is the store's socket.
        self.kv: KeyValue | None = KeyValue() if secret is not None else None
        self._host = host
        self._gloo_host: str | None = None if host in ("*", "0.0.0.0", "::") else host
        self._store: Any = None
        self._prefix = ""
        self._pg: Any = None
        self._members: list[bytes] = []
        self._pending: tuple[str, str, int, int] | None = None  # backend, prefix, world, CTAs
        self._descs: dict[bytes, dict[str, Any]] = {}
        self._bufs: list[torch.Tensor] = []
        self._side: torch.cuda.Stream | None = None
        self._outcome = self._outcome_host = torch.zeros(1, dtype=torch.int32)  # see COMMITTED
        self._cut_why: tuple[Any, str] = (None, "")  # a group aborted from the loop, and why
        self._streaming: Any = None  # the group a push streams on
        self._works: list[Any] = []  # the last push's work on it
        self._timeout = 60.0
        self._high_priority = high_priority  # NCCL's streams, here and at every receiver
        self.groups_formed = 0

    # -- the group ---------------------------------------------------------------
    def group_for(
        self, keys: list[bytes], timeout: float, device: torch.device
    ) -> dict[bytes, dict[str, Any]] | None:
        """A descriptor per member when the group must be (re)formed, else None."""
        if self.has_group(keys):
            return None
        self._let_go()
        self._cut_why = (None, "")
        if self._store is None:
            self._store = self._make_store(timeout)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if self.kv is not None and self._prefix:
            self._loop_run(self._drop(self._prefix))
        prefix = self._prefix = f"rlferry/{os.getpid()}/{next(_epochs)}"
        world = len(keys) + 1
        self._pending = (backend, prefix, world, self.max_ctas)
        self._members = list(keys)
        self._timeout = timeout
        self.generation += 1
        self._descs = {
            k: {
                "backend": backend,
                "store": "control" if self.kv is not None else "tcp",
                "port": 0 if self.kv is not None else self._store.port,
                "prefix": prefix,
                "rank": r + 1,
                "world": world,
                "timeout": timeout,
                "high_priority": self._high_priority,
                "max_ctas": self.max_ctas,
            }
            for r, k in enumerate(keys)
        }
        return self._descs

    def has_group(self, keys: list[bytes]) -> bool:
        return self._pg is not None and keys == self._members

    def _make_store(self, timeout: float) -> Any:
        if self.kv is None:
            return loopback_store(self._host)
        kv, run = self.kv, self._loop_run
        return CallStore(lambda op: run(kv.serve(op)), timeout)

    @staticmethod
    def _loop_run(coro: Any) -> Any:
        return wire_loop().run(coro)

    async def _drop(self, prefix: str) -> None:
        assert self.kv is not None
        self.kv.drop(prefix)

    @property
    def store_address(self) -> tuple[str, int] | None:
        """Where the rendezvous store listens, or None (none yet, or on the control channel)."""
        if self._store is None or self.kv is not None:
            return None
        return self._host, int(self._store.port)

    def current(self, key: bytes) -> dict[str, Any]:
        return {**self._descs[key], "rejoin": False}

    def form(self, deadline: float) -> None:
        """Join the group being formed as rank 0 (blocks until every receiver joined)."""
        if self._pending is None:
            return
        backend, prefix, world, ctas = self._pending
        self._pending = None
        try:
            pg = make_group(backend, self._store, prefix, 0, world, self._timeout, self._gloo_host,
                             self._high_priority, ctas)  # fmt: skip
            self._warm(pg)
        except Exception as e:
            raise WeightSyncError(
                f"forming the {backend} group of {world} ranks failed: {type(e).__name__}: {e}"
            ) from None
        self._pg = pg
        self.groups_formed += 1

    def _warm(self, pg: Any) -> None:
        dev = self._bufs[0].device if self._bufs else torch.device("cpu")
        one = torch.zeros(1, device=dev)
        limit = None if dev.type == "cuda" else self._timeout
        wait(pg.broadcast([one], broadcast_options()), limit)
        if dev.type == "cuda":  # this stream only: another link's receives may be running
            torch.cuda.current_stream(dev).synchronize()

    def receiver_left(self, key: bytes) -> None:
        """On the wire loop: a member left (its process died, say). NCCL would wait for it
        until the group's timeout: the group is aborted, so that a push streaming to it
        fails at once; the next forms it anew."""
        if key in self._members:
            self._cut(self._pg, "a receiver left mid-stream")

    def deadline_passed(self) -> None:
        """On the wire loop, at a push's deadline: a stream still going waits on NCCL (a
        peer stuck, say) until the group's timeout; it is aborted now, and the push
        raises ``PushTimeout``."""
        self._cut(self._streaming, "the push's timeout passed mid-stream")

    def _cut(self, pg: Any, why: str) -> None:
        if pg is None or isinstance(pg, dist.ProcessGroupGloo):
            return  # gloo: a member's sockets closing fails its peers' waits, and a wait ends
        self._cut_why = (pg, why)  # at its timeout
        if self._pg is pg:
            self._pg = None
        wire_loop().loop.run_in_executor(None, abort, pg)  # off the loop: an abort takes a while

    def broken(self) -> None:
        """A push failed mid-stream: the group is dropped and formed anew next time."""
        self._let_go(broken=True)
        self._members = []

    def _let_go(self, broken: bool = False) -> None:
        group, works = [self._pg], self._works
        self._pg, self._works = None, []
        if group[0] is not None:
            release(group, works, broken)

    # -- buffers and the stream --------------------------------------------------------
    def prepare(self, nbytes: int, device: torch.device) -> None:
        if self._bufs and self._bufs[0].device == device and self._bufs[0].numel() >= nbytes:
            return
        self._bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        # a link's packs and sends go on a stream of its own: on the caller's stream, each
        # pack of a rank's links would queue behind the others' (a pack waits for the send
        # of the bucket before last in its buffer), so that one link's sends would wait on
        # another link's receiver, and its end for every link's packs
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._outcome = torch.zeros(1, dtype=torch.int32, device=device)
        self._outcome_host = self._outcome  # read once the side stream is done: not the caller's
        if self._side is not None:
            self._outcome_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        load_kernels(device)  # before the group forms: never while a link's NCCL work runs

    def buffer(self, b: int) -> torch.Tensor:
        return self._bufs[b]

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self._bufs)

    def stream(
        self,
        plan: Plan,
        buckets: Iterator[tuple[int, list[Any]]],
        packer: Any,
        verify: bool,
        deadline: float,
        packed: bool = False,
    ) -> Generator[bool | None, None, bool]:
        pg, opts = self._pg, broadcast_options()
        if pg is None:
            raise WeightSyncError("the broadcast group is not formed")
        nccl, side = self._bufs[0].is_cuda, self._side
        self._streaming = pg
        caller = None
        if side is not None:  # the caller's tensors (and bucket 0 if ``packed``) first
            caller = torch.cuda.current_stream(side.device)
            side.wait_stream(caller)
        works: list[Any] = [None, None]
        self._works = works  # what a group dropped mid-push waits for (see release)
        sums: list[int] = []
        k, failure, what = -1, "", ""
        try:
            for k, tensors in buckets:
                b = k % 2
                with torch.cuda.stream(side):  # left before each yield: not the others'
                    if works[b] is not None:
                        wait(works[b], None if nccl else deadline - time.monotonic())
                    if k or not packed:
                        packer.pack(k, tensors)
                    view = self._bufs[b][: plan.bucket_used[k]]
                    if verify:
                        sums.append(checksum(view))
                    works[b] = pg.broadcast([view], opts)
                yield False
            with torch.cuda.stream(side):
                if verify:
                    t = torch.tensor(sums, dtype=torch.int64, device=self._bufs[0].device)
                    works.append(pg.broadcast([t], opts))
                self._outcome.zero_()
                works.append(pg.allreduce([self._outcome], max_options()))
                if nccl:
                    self._outcome_host.copy_(self._outcome, non_blocking=True)
            yield True  # what follows blocks: a rank's other links enqueue first (take_turns)
            with torch.cuda.stream(side):
                for i, w in enumerate(works):
                    if w is not None:
                        what = "the receivers' commits" if i == len(works) - 1 else ""
                        wait(w, None if nccl else deadline - time.monotonic())
            if side is not None:  # one wait on the device for the buckets and the outcome
                what = f"the broadcast of {plan.buckets} buckets or the receivers' commits"
                settled(pg, works, side)
            what = ""
            if self._cut_why[0] is pg:
                failure = f"{self._cut_why[1]} (the group was aborted)"
        except RuntimeError as e:  # the collective broke: a receiver died or timed out
            failure = first_line(e)
            if self._cut_why[0] is pg:
                failure = f"{self._cut_why[1]} (the group was aborted): {failure}"
        finally:
            # this frame, kept by a traceback (an interrupt's, until the garbage collector
            # takes it), must not keep the group (and its receivers' sockets) alive
            pg, works, self._streaming = None, [], None
            if side is not None and caller is not None:  # the caller's later work (its
                caller.wait_stream(side)  # tensors freed, reused) follows every read
        if failure:
            self.broken()  # (its work still pending is waited for off this thread)
            what = what or f"the broadcast of bucket {k} of {plan.buckets}"
            if time.monotonic() >= deadline:  # gloo's wait ran out: the push's timeout
                raise PushTimeout(f"{what} did not finish within the push's timeout: {failure}")
            raise WeightSyncError(f"{what} failed: {failure}")
        return int(self._outcome_host[0]) == COMMITTED

    def close(self) -> None:
        self._let_go()
        self._store, self._bufs = None, []
        self.kv = None
