"""The ``broadcast`` transport's receiver: its end of the ``torch.distributed`` group its
sender forms (see ``_distributed_sender``), with its two bucket buffers."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._errors import WeightSyncError
from ..copies._copy import load_kernels
from ..planning._buckets import Plan
from ..protocol._messages import StoreOp, StoreReply
from ._base import CollectiveReceiver, checksum
from ._groups import (
    COMMITTED,
    FAILED,
    Cut,
    abort,
    broadcast_options,
    first_line,
    make_group,
    max_options,
    release,
    settled,
    wait,
)
from ._rendezvous import CallStore, local_host_towards

__all__ = ["DistributedReceiver"]


class DistributedReceiver(CollectiveReceiver):
    """A receiver's end of the group, with its two bucket buffers."""

    def __init__(self) -> None:
        self._pg: Any = None
        self._prefix = ""
        self._bufs: list[torch.Tensor] = []
        self._stream: torch.cuda.Stream | None = None
        self._outcome = torch.zeros(1, dtype=torch.int32)  # see COMMITTED
        self._told: Any = None  # the last outcome's all-reduce (gloo: waited next stream)
        self._cut: Cut | None = None  # ends this stream's gloo waits (see aborter)
        self._timeout = 60.0
        self.opened = 0
        self.groups_joined = 0

    def join(
        self, desc: dict[str, Any], host: str, device: torch.device | None,
        call: Callable[[StoreOp], StoreReply],
    ) -> None:  # fmt: skip
        """Join the group ``desc`` names; ``host``: the sender's; ``call``: a store operation
        sent over the control channel (for a sender whose group meets there)."""
        try:
            backend, port, prefix = str(desc["backend"]), int(desc["port"]), str(desc["prefix"])
            rank, world, timeout = int(desc["rank"]), int(desc["world"]), float(desc["timeout"])
            kind, high = str(desc["store"]), bool(desc["high_priority"])
            ctas = int(desc["max_ctas"])
        except (KeyError, TypeError, ValueError):
            raise WeightSyncError("malformed setup: bad broadcast group") from None
        if kind not in ("tcp", "control"):
            raise WeightSyncError(
                f"malformed setup: broadcast store: expected 'tcp' or 'control', got {kind!r}"
            )
        if prefix == self._prefix and self._pg is not None:
            return
        self.leave()
        dev = self.device(backend, device)
        self._timeout = timeout
        td = datetime.timedelta(seconds=max(1.0, timeout))
        try:
            store: Any
            if kind == "tcp":
                store = dist.TCPStore(host, port, None, False, timeout=td, use_libuv=True)
            else:
                store = CallStore(call, timeout)
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
                load_kernels(dev)  # never while a link's NCCL work runs (_copy_kernel.load)
            pg = make_group(backend, store, prefix, rank, world, timeout,
                             local_host_towards(host), high, ctas)  # fmt: skip
            one = torch.zeros(1, device=dev)
            wait(pg.broadcast([one], broadcast_options()), None if dev.type == "cuda" else timeout)
            if dev.type == "cuda":  # this stream only: the rank's other links may be streaming
                torch.cuda.current_stream(dev).synchronize()
        except Exception as e:
            where = f"{host}:{port}" if kind == "tcp" else f"{host} (over the control channel)"
            raise WeightSyncError(
                f"joining the {backend} group at {where} as rank {rank} of {world} failed: "
                f"{type(e).__name__}: {e}"
            ) from None
        self._pg, self._prefix = pg, prefix
        self.groups_joined += 1
        self._outcome, self._told = torch.zeros(1, dtype=torch.int32, device=dev), None
        if dev.type == "cuda":
            self._stream = torch.cuda.Stream(dev)

    @staticmethod
    def device(backend: str, device: torch.device | None) -> torch.device:
        if backend == "nccl":
            if device is None or device.type != "cuda":
                if not torch.cuda.is_available():
                    raise WeightSyncError(
                        "transport 'broadcast': the sender's tensors are on CUDA (NCCL), "
                        "this receiver has no CUDA device"
                    )
                return torch.device("cuda", torch.cuda.current_device())
            return device
        return torch.device("cpu")

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self._bufs)

    def buffers(self, nbytes: int) -> list[torch.Tensor]:
        dev = self._stream.device if self._stream is not None else torch.device("cpu")
        if not (self._bufs and self._bufs[0].numel() >= nbytes):
            self._bufs = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2)]
            self.opened += 2
        return self._bufs

    def stream(
        self, plan: Plan, on_bucket: Callable[[int, torch.Tensor], None], verify: bool
    ) -> str | None:
        """Receive every bucket, calling ``on_bucket`` on each; the first error, or None.

        A failing ``on_bucket`` does not stop the collectives: the group stays
        in step with the sender, the later buckets are received and dropped.
        """
        pg, opts = self._pg, broadcast_options()
        if pg is None:
            raise WeightSyncError("not in a broadcast group")
        ctx = (
            torch.cuda.stream(self._stream)
            if self._stream is not None
            else contextlib.nullcontext()
        )
        error: str | None = None
        n, used = plan.buckets, plan.bucket_used
        bufs = self._bufs
        limit = None if self._stream is not None else self._timeout
        cut = self._cut
        sums: list[int] = []
        works: list[Any] = []
        failure = ""
        with ctx:
            try:
                if self._told is not None:  # the last push's outcome went (gloo: on its thread)
                    wait(self._told, limit, cut)
                    self._told = None
                works = [pg.broadcast([bufs[0][: used[0]]], opts), None]
                for k in range(n):
                    b = k % 2
                    wait(works[b], limit, cut)
                    if k + 1 < n:
                        works[1 - b] = pg.broadcast([bufs[1 - b][: used[k + 1]]], opts)
                    if verify:
                        sums.append(checksum(bufs[b][: used[k]]))
                    if error is None:
                        try:
                            on_bucket(k, bufs[b])
                        except Exception as e:
                            error = f"load raised {type(e).__name__}: {e} (at bucket {k} of {n})"
                if verify:
                    t = torch.zeros(n, dtype=torch.int64, device=bufs[0].device)
                    wait(pg.broadcast([t], opts), limit, cut)
                    bad = [k for k in range(n) if int(t[k]) != sums[k]]
                    if bad and error is None:
                        error = (
                            f"checksum mismatch in bucket {bad[0]} of {n} (the data came corrupt)"
                        )
                if self._stream is not None:
                    settled(pg, works, self._stream)
            except RuntimeError as e:
                failure = first_line(e)
        if failure:  # the group broke (the sender or another receiver died): leave it,
            pending = [w for w in works if w is not None]  # its receives let go off this thread
            works.clear()
            del pg
            self.leave(pending)
            return f"the broadcast broke: {failure}"
        return error

    def tell(self, committed: bool) -> None:
        """Add this receiver's outcome of the stream that just ended to the push's last
        exchange (see :data:`COMMITTED`); nothing if the stream broke (the group is left)."""
        pg = self._pg
        if pg is None:
            return
        ctx = (
            torch.cuda.stream(self._stream)
            if self._stream is not None
            else contextlib.nullcontext()
        )
        with ctx:
            self._outcome.fill_(COMMITTED if committed else FAILED)
            self._told = pg.allreduce([self._outcome], max_options())

    def aborter(self) -> Callable[[], None] | None:
        """What aborts the next stream of this group's side here from another thread (it
        then ends at once), or None outside a group. NCCL's group is aborted; gloo's waits
        on the CPU are cut (see :class:`Cut`)."""
        pg = self._pg
        if pg is None:
            return None
        if self._stream is None:
            self._cut = Cut()
            return self._cut
        return lambda: abort(pg)

    def leave(self, pending: list[Any] | None = None) -> None:
        """Leave the group; ``pending``: its work that may never end (a stream cut short)."""
        group, told = [self._pg], self._told
        self._pg, self._prefix, self._told, self._cut = None, "", None, None
        if group[0] is not None:  # its last outcome's all-reduce may wait for a sender that
            release(group, [told, *(pending or [])])  # gave up

    def close(self) -> None:
        self.leave()
        self._bufs = []
