"""A link's ``torch.distributed`` group, made and let go by rlferry (the ``broadcast``
transport's sender and receivers): its options, the waits on its work, and its end."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ._rendezvous import gloo_device

__all__ = [
    "COMMITTED",
    "FAILED",
    "Cut",
    "abort",
    "broadcast_options",
    "first_line",
    "make_group",
    "max_options",
    "release",
    "settled",
    "wait",
]

log = logging.getLogger("rlferry.weights")

_ERRORS = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_env = threading.Lock()


@contextlib.contextmanager
def _errors_contained() -> Iterator[None]:
    """While an NCCL group is made: torch's watchdog, by default (``_ERRORS`` 3), takes the
    whole process down when a collective of the group fails or times out; 2 aborts the
    group's communicators and fails its works, and the process lives. torch reads it as
    the group is made; the variable is as it was after (the user's own groups keep theirs).
    A link's failure fails that push: never the trainer, never the engine."""
    with _env:
        before = os.environ.get(_ERRORS)
        os.environ[_ERRORS] = "2"
        try:
            yield
        finally:
            if before is None:
                del os.environ[_ERRORS]
            else:
                os.environ[_ERRORS] = before


def broadcast_options() -> Any:
    o = dist.BroadcastOptions()
    o.rootRank = 0
    o.rootTensor = 0
    return o


def max_options() -> Any:
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
    return o


# A push's last exchange, after its buckets: every receiver adds its outcome (0 committed,
# 1 failed) to a MAX all-reduce with the sender's 0, once it committed or failed. The
# sender's push ends on the result, 0, without waiting for the receivers' acks to cross
# the control channel (0.8-1.0 ms from an engine's commit to its trainer's thread on four
# H100s: a send, the wire loop's wake, the pushing thread's); the all-reduce comes
# through the device. Its acks still come (the hub waits for them before the next
# push); a 1 sends the sender to them for the reason.
COMMITTED, FAILED = 0, 1


def make_group(
    backend: str, store: Any, prefix: str, rank: int, world: int, timeout: float,
    host: str | None, high_priority: bool, max_ctas: int = 0,
) -> Any:  # fmt: skip
    """A group over ``store``; gloo's sockets listen on ``host`` (None: torch's default);
    NCCL's streams at high priority if ``high_priority`` (its kernels then take SMs before
    the pack and load copies queued beside them: the collective is what bounds a push);
    NCCL's kernels at most ``max_ctas`` thread blocks (0: NCCL's own choice), which also
    bounds the buffers NCCL allocates for the group (about 9 MiB a block, measured)."""
    td = datetime.timedelta(seconds=max(1.0, timeout))
    pstore = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        # a backstop: a push ends at its own timeout (the sender aborts the group, its
        # receivers' watches theirs); torch's watchdog, handling a timeout while a thread
        # enqueues on the group, can stop both for good
        opts._timeout = datetime.timedelta(seconds=max(2 * timeout, timeout + 60))
        opts.is_high_priority_stream = high_priority
        if max_ctas:
            opts.config.max_ctas = max_ctas
        with _errors_contained():
            return dist.ProcessGroupNCCL(pstore, rank, world, opts)
    gopts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gopts._devices = [gloo_device(host)]
    gopts._timeout = td
    return dist.ProcessGroupGloo(pstore, rank, world, gopts)


class Cut:
    """Ends a gloo stream's waits from another thread: a receiver's watch heard that the
    sender aborted the push. Gloo waits on the CPU and its peers' sockets closing end
    those waits; but a sender that gave a push up mid-stream (a Ctrl-C, an error) keeps
    its group's sockets open while anything holds the group (a traceback, until the
    garbage collector takes it), and its receiver would wait the group's timeout (120 s)
    for a bucket never sent. One per stream (:meth:`DistributedReceiver.aborter`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: queue.SimpleQueue[Any] | None = None
        self.why = ""

    def __call__(self) -> None:
        with self._lock:
            self.why = "the sender aborted the push"
            if self._waiting is not None:
                self._waiting.put(None)

    def watch(self, done: queue.SimpleQueue[Any]) -> None:
        with self._lock:
            self._waiting = done
            if self.why:
                done.put(None)


def wait(work: Any, timeout: float | None, cut: Cut | None = None) -> None:
    """Wait for ``work``: for NCCL the current stream waits (``timeout=None``), the CPU does
    not; for gloo the CPU waits, at most ``timeout``, on a queue the work's future puts to
    (or ``cut``): gloo's own wait holds the thread in C++, where a signal (Ctrl-C) does not
    reach a main thread that waits there for a receiver's commit, the push's timeout long.
    The future's callback is the queue's own ``put`` (C, no Python frame): a future done
    already runs it on this thread, and torch swallows a Ctrl-C that lands in a Python
    callback there (it logs it; the push would then wait for its timeout)."""
    if timeout is None:
        work.wait()
        return
    done: queue.SimpleQueue[Any] = queue.SimpleQueue()
    work.get_future().add_done_callback(done.put)
    if cut is not None:
        cut.watch(done)
    try:
        done.get(timeout=max(0.001, timeout))
    except queue.Empty:
        raise RuntimeError(f"timed out after {timeout:.3g} s") from None
    if cut is not None and cut.why:
        raise RuntimeError(cut.why)
    work.wait()  # done: raises its error, if it failed


def settled(pg: Any, works: list[Any], stream: Any) -> None:
    """NCCL reports a failed collective asynchronously: once ``stream`` (which waited for
    every work) is done, ask each work and the group for an error, so that a push that
    met one raises instead of committing. A work asked with a timeout raises its error;
    all are complete here, so nothing waits (torch's timed wait would poll)."""
    stream.synchronize()
    for w in works:
        if w is not None:
            w.wait(datetime.timedelta(seconds=60))
    error = pg.get_error() if hasattr(pg, "get_error") else None
    if error is not None and error.name != "SUCCESS":
        raise RuntimeError(f"NCCL reported {error.name} on the group")


def abort(pg: Any) -> None:
    """Tear a group down so that its peers' pending operations fail at once.

    NCCL needs an abort (in-flight kernels exit); a gloo group closes its
    connections when the last reference goes, and its abort does not.
    """
    if isinstance(pg, dist.ProcessGroupGloo):
        return
    for name in ("abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:  # a group already broken may refuse either; it goes all the same
                log.debug("process group %s failed", name, exc_info=True)
            return


def release(group: list[Any], works: list[Any], broken: bool = False) -> None:
    """Let the group in ``group`` go (a list holding the caller's only reference: this
    takes it); ``works``: the last push's work on it. NCCL's is aborted (its pending work
    fails at once). Gloo's destructor waits for the group's pending work, whose peer half
    may never come (a push given up mid-stream; a receiver's outcome of it, never joined)
    until the group's timeout: the caller, a sender forming its next group or a receiver
    joining it, would wait that long there (120 s, for a push interrupted while a receiver
    loads its one bucket). So a gloo group with work pending goes on a thread of its own,
    once that work ended; so does one given up mid-push (``broken``): a Ctrl-C that lands
    just after a call posted work, before the work was kept, leaves it pending unseen (the
    pushing thread would wait for it, 120 s)."""
    pg = group[0]
    if not isinstance(pg, dist.ProcessGroupGloo):
        group.clear()
        abort(pg)
        return
    del pg
    pending = [w for w in works if w is not None and not w.is_completed()]
    if pending or broken:
        threading.Thread(
            target=_drop_after, args=(group, pending), name="rlferry-gloo-release", daemon=True
        ).start()
    else:
        group.clear()


def _drop_after(group: list[Any], works: list[Any]) -> None:
    """Drop the list's reference to a gloo group once every one of ``works`` ended (the
    caller's references went meanwhile, or they go with no work left to wait for)."""
    for w in works:
        try:
            w.wait()
        except RuntimeError as e:  # its peer went, or the group's timeout passed: it ended
            log.debug("a dropped group's work ended: %s", first_line(e))
    group.clear()


def first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
