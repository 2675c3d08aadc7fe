"""An engine's decode thread and the state its coroutines share with it.

Everything under ``_cond`` is shared: the requests in flight, the gates that stop
stepping, commands for the thread (aborts) and callers waiting for a step boundary
(pause, start_weight_update). The thread waits on ``_cond`` whenever it cannot step or
has nothing to do, and every change of that state notifies it. The running batch is
the thread's alone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from rlferry.control import EngineClosed, EngineError, EngineGone

from ._batch import Batch, Row
from ._bridge import Waiter, settle
from ._slots import SlotBatch

__all__ = ["Abort", "DecodeThread"]

log = logging.getLogger("rlferry.engines")

STEP_BOUND = 600.0
"""Seconds a weight load and ``close`` wait for the step in progress to end."""
JOIN_SHARE = 4
"""Waiting rows join a decoding batch once they are at least 1/JOIN_SHARE of its rows..."""
JOIN_AFTER = 4
"""... or once they could have joined for JOIN_AFTER decode steps."""


def joining(running: int, joinable: int, deferred: int) -> bool:
    """Whether ``joinable`` waiting rows join now. A join is a forward pass of its own (a
    prefill) instead of a decode step of the ``running`` rows, so while rows decode, a few
    rows that trickle in wait to join together, as text-generation-inference's
    waiting-served ratio does: joining one by one took 10 forward passes per 128 samples
    of the demo on an H200 where a batch that starts together takes 7."""
    if joinable <= 0:
        return False
    return running == 0 or joinable * JOIN_SHARE >= running or deferred >= JOIN_AFTER


Abort = tuple[set[str] | None, Waiter | None]
"""Request ids to end (None: all), and who waits for the count."""


class DecodeThread:
    """The decode loop: at each step boundary it applies aborts, resolves the callers
    waiting for the engine to stop, admits waiting requests into the batch, and runs one
    forward pass (a prefill of the admitted, else a decode step of the batch)."""

    def __init__(
        self,
        name: str,
        batch: Batch | SlotBatch,
        *,
        version: int,
        max_batch: int,
        max_prefill: int,
    ) -> None:
        self.name = name
        self._batch = batch
        self._max_batch = max_batch
        self._max_prefill = max_prefill
        self._cond = threading.Condition()
        # -- under _cond ----------------------------------------------------------------
        self._ids: dict[str, Row] = {}  # every request in flight, by id
        self._staged: dict[asyncio.AbstractEventLoop, list[Row]] = {}  # this loop iteration's
        self._waiting: deque[Row] = deque()  # not admitted yet
        self._aborts: list[Abort] = []
        self._waiters: list[Waiter] = []  # pause / start_weight_update, until stopped
        self._paused = False
        self._draining = False  # pause("wait"): admit nothing, pause once the rows end
        self._updating = False  # between start_weight_update and finish_weight_update
        self._loading = False  # from a push's first load to its commit (or for good)
        self._refusing: str | None = None  # a failed finish_weight_update, until a commit
        self._in_step = False
        self._deferred = 0  # decode steps run while rows could have joined
        self._closing = False
        self._dead: str | None = None  # why the thread ended (closed, or it failed)
        self._gone: type[EngineGone] = EngineGone  # EngineClosed once closed by its owner
        self._version = version
        self._since_commit = 0  # buckets loaded since the last commit
        self._load_error: str | None = None  # why the last load failed
        self._update_since: float | None = None  # an update (or a push) under way since
        self._error: str | None = None
        self._counts = dict.fromkeys(("finished", "aborted", "tokens", "steps", "updates"), 0)
        self._seconds = dict.fromkeys(("step", "paused", "update"), 0.0)
        self._blocked_since: float | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"rlferry-engine-{name}", daemon=True
        )

    # -- the shared state (under _cond) -----------------------------------------------------
    def _blocked(self) -> bool:
        return self._paused or self._updating or self._loading or self._refusing is not None

    def _gate_changed(self) -> None:
        """Account the time stepping was stopped and wake the thread (under ``_cond``)."""
        now = time.monotonic()
        if self._blocked():
            if self._blocked_since is None:
                self._blocked_since = now
        elif self._blocked_since is not None:
            self._seconds["paused"] += now - self._blocked_since
            self._blocked_since = None
        self._cond.notify_all()

    def _drop_waiters(self, kind: str, why: str) -> None:
        keep = []
        for w in self._waiters:
            if w.kind == kind:
                w.fail(EngineError(self.name, why))
            else:
                keep.append(w)
        self._waiters = keep

    def _alive(self) -> None:
        if self._dead is not None:
            raise self._gone(self.name, self._dead)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """The rows ``loop`` staged in its last iteration join the waiting ones (they are
        prefilled together), or fail if the engine ended since."""
        with self._cond:
            rows = self._staged.pop(loop, [])
            if self._dead is None:
                self._waiting.extend(rows)
                self._cond.notify_all()
                return
            for r in rows:
                self._ids.pop(r.request_id, None)
        for r in rows:
            if not r.future.done():
                r.future.set_exception(self._gone(self.name, self._dead))

    # -- a push's gate (the receiver's threads) ---------------------------------------------
    def _stop_for_load(self) -> None:
        """Stop stepping (at a push's first bucket) and wait for the step in progress to
        end; raise ``EngineError`` if it does not within ``STEP_BOUND``."""
        with self._cond:
            first = not self._loading
            if first:
                self._loading = True
                self._load_error = None
                if self._update_since is None:
                    self._update_since = time.monotonic()
                self._gate_changed()
            if not self._cond.wait_for(lambda: not self._in_step, STEP_BOUND):
                if first:
                    self._loading = False
                    self._gate_changed()
                raise EngineError(
                    self.name, f"its decode step did not end within {STEP_BOUND:g} s, so "
                    "the push was not loaded (a step that long is a bug: please report it)",
                )  # fmt: skip

    def _loaded(self) -> None:
        """A bucket of the push loaded."""
        with self._cond:
            self._since_commit += 1

    def _load_failed(self, e: Exception, *, refused: bool) -> None:
        """A bucket failed to load: ``refused`` before anything was copied (the model is
        still whole if no bucket of the push loaded before), else the model holds a mix
        and no step runs until a version commits whole."""
        with self._cond:
            self._load_error = f"{type(e).__name__}: {e}"
            if refused and self._since_commit == 0:
                self._loading = False  # nothing was loaded: the model is still whole
                if not self._updating:
                    self._update_since = None
                self._error = f"weights: a push was refused before loading ({e})"
            else:
                self._error = (
                    f"weights: a push failed after {self._since_commit} of its buckets "
                    f"were loaded ({type(e).__name__}: {e}); the model holds a mix of "
                    "versions: no step runs until a version commits whole"
                )
            self._gate_changed()

    def _on_commit(self, version: int) -> None:
        """The receiver committed ``version`` whole: it is served from the next step."""
        with self._cond:
            self._version = version
            self._loading = False
            self._refusing = None
            self._load_error = None
            self._since_commit = 0
            self._counts["updates"] += 1
            if not self._updating:
                self._update_done()
            self._gate_changed()

    def _update_done(self) -> None:
        """Account the update's seconds (under ``_cond``)."""
        if self._update_since is not None:
            self._seconds["update"] += time.monotonic() - self._update_since
            self._update_since = None

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        try:
            with torch.inference_mode():
                self._serve()
        except BaseException as e:  # a bug: never hide it, fail every waiter with it
            log.exception("engine %s: its decode thread failed", self.name)
            error = e
        finally:
            self._shutdown(error)

    def _serve(self) -> None:
        batch = self._batch
        if batch.device.type == "cuda":
            torch.cuda.set_device(batch.device)
            # cuDNN's fused attention builds a plan for every new shape, and a decode loop
            # makes new shapes all the time (rows join and leave, the cache grows): on an
            # H100 it made a batch whose rows end at their own lengths 2.7x slower than
            # model.generate. torch's flag is process-wide: flash and memory-efficient
            # attention serve this process from now on.
            torch.backends.cuda.enable_cudnn_sdp(False)
        while True:
            admit: list[Row] = []
            aborts: list[Abort] | None = None
            with self._cond:
                while True:
                    if self._aborts:
                        aborts, self._aborts = self._aborts, []
                        taken = self._take_queued(aborts)
                        break
                    if self._closing:
                        return
                    if self._blocked():
                        for w in self._waiters:
                            w.resolve(None)
                        self._waiters = []
                    elif self._draining and not batch.rows:
                        self._paused, self._draining = True, False
                        self._gate_changed()
                        continue
                    else:
                        admit = [] if self._draining else self._admit()
                        if admit or batch.rows:
                            self._in_step = True
                            version = self._version
                            break
                    self._cond.wait()  # woken by every change of requests, gates or commands
            if aborts is not None:
                self._apply_aborts(aborts, taken)
                continue
            self._step(admit, version)

    def _admit(self) -> list[Row]:
        """The waiting rows that join at this boundary (under ``_cond``): as many as fit
        (``max_batch`` rows, ``max_prefill`` padded prompt tokens: of the distinct prompts
        where the batch shares them), when :func:`joining` says so."""
        room = self._max_batch - len(self._batch.rows)
        n = width = 0
        prompts: set[tuple[int, ...]] = set()  # a batch that shares them: the distinct ones
        for row in itertools.islice(self._waiting, max(0, room)):
            w = max(width, len(row.request.prompt_ids))
            if self._batch.shares_prompts:
                prompts.add(row.prompt)
            runs = len(prompts) if self._batch.shares_prompts else n + 1
            if n and self._batch.prefill_tokens(runs, w) > self._max_prefill:
                break
            n, width = n + 1, w
        if not joining(len(self._batch.rows), n, self._deferred):
            self._deferred += n > 0
            return []
        self._deferred = 0
        return [self._waiting.popleft() for _ in range(n)]

    def _step(self, admit: list[Row], version: int) -> None:
        batch = self._batch
        n = len(admit) or len(batch.rows)
        t0 = time.perf_counter()
        failed: Exception | None = None
        try:
            ended = batch.prefill(admit, version) if admit else batch.decode(version)
        except Exception as e:
            failed, ended = e, []
        with self._cond:
            self._in_step = False
            self._counts["steps"] += 1
            self._seconds["step"] += time.perf_counter() - t0
            if failed is None:
                self._counts["tokens"] += n
            else:
                self._error = f"a step failed: {type(failed).__name__}: {failed}"
            self._cond.notify_all()
        if failed is not None:
            log.error("engine %s: %s", self.name, self._error)
            rows = list(dict.fromkeys(batch.rows + admit))
            batch.clear()  # its cache may be half updated
            self._end(rows, f"{self._error} (the request's tokens are lost: resubmit it)")
        self._end(ended)

    def _take_queued(self, aborts: list[Abort]) -> list[Row]:
        """Take the queued rows that ``aborts`` name (under ``_cond``)."""
        hit = _aborted_by(aborts)
        taken = [r for r in self._waiting if hit(r)]
        self._waiting = deque(r for r in self._waiting if not hit(r))
        for loop, rows in self._staged.items():
            taken += [r for r in rows if hit(r)]
            self._staged[loop] = [r for r in rows if not hit(r)]
        return taken

    def _apply_aborts(self, aborts: list[Abort], taken: list[Row]) -> None:
        """End the running rows that ``aborts`` name and the queued ones ``taken``; tell
        each caller of ``abort_requests`` how many of its requests ended."""
        hit = _aborted_by(aborts)
        running = [r for r in self._batch.rows if hit(r)]
        self._batch.remove(running)
        ended = running + taken
        for r in ended:
            r.finish = "abort"
        self._end(ended)
        for ids, waiter in aborts:
            if waiter is not None:
                waiter.resolve(sum(ids is None or r.request_id in ids for r in ended))

    def _end(
        self, rows: list[Row], error: str | None = None, kind: type[EngineError] = EngineError
    ) -> None:
        """Tell the callers of ``rows`` that they ended (with ``error``: that they failed,
        raising ``kind``)."""
        if not rows:
            return
        with self._cond:
            for r in rows:
                self._ids.pop(r.request_id, None)
                if error is None:
                    self._counts["aborted" if r.finish == "abort" else "finished"] += 1
        for r in rows:
            if error is not None:
                settle(r.loop, r.future, error=kind(self.name, error))
            else:
                assert r.finish is not None
                settle(r.loop, r.future, r.completion(self.name, r.finish))

    def _shutdown(self, error: BaseException | None) -> None:
        """The thread ends: everything in flight or waiting fails, now and from now on."""
        with self._cond:
            self._closing = True
            self._dead = (
                "closed (make a new engine)"
                if error is None
                else f"its decode thread failed: {type(error).__name__}: {error} (a bug: "
                "please report it)"
            )
            self._gone = EngineClosed if error is None else EngineGone
            rows = list(self._batch.rows) + list(self._waiting)
            for staged in self._staged.values():
                rows += staged
            self._waiting.clear()
            self._staged.clear()
            waiters = self._waiters + [w for _, w in self._aborts if w is not None]
            self._waiters, self._aborts = [], []
            self._cond.notify_all()
        unfinished = f"{self._dead}: the request ended unfinished (resubmit it)"
        self._end(rows, unfinished, self._gone)
        for w in waiters:
            w.fail(self._gone(self.name, self._dead))


def _aborted_by(aborts: list[Abort]) -> Callable[[Row], bool]:
    """Whether one of ``aborts`` names a row."""
    every = any(ids is None for ids, _ in aborts)
    named: set[str] = set().union(*(ids for ids, _ in aborts if ids is not None))
    return lambda row: every or row.request_id in named
