"""The gate between an rlferry receiver's thread and a vLLM worker's thread.

A ``WeightReceiver`` loads each bucket on its own thread, whenever the trainer pushes.
A vLLM worker may only load weights while it is inside a weight update (between
``start_weight_update`` and ``finish_weight_update``, its model's layers set up for
reloading) and only in the worker's own thread, between engine steps. The gate joins
the two: the receiver's ``load`` hands each bucket to the thread that runs
``update_weights`` and waits until that thread loaded it; ``update_weights`` opens the
gate, loads what comes, and returns once the receiver committed the version it
waits for, or raises with the receiver's reason. Nothing polls: both sides wait on
one condition, each wait bounded.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from rlferry.weights import WeightSyncError

__all__ = ["Gate", "GateError"]

_IDLE, _STARTED, _OPEN, _ENDED = "idle", "started", "open", "ended"


class GateError(WeightSyncError, RuntimeError):
    """A weight update that did not commit its version (the message says why)."""


class _Job:
    __slots__ = ("done", "error", "items")

    def __init__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.items = items
        self.done = False
        self.error: BaseException | None = None


class Gate:
    """Loads pushed buckets on the thread of ``run`` only, while an update is open.

    ``wait``: seconds a bucket that comes before ``run`` opened the gate waits for it
    (a push that starts a moment before the worker's ``update_weights`` arrives).
    States: idle (no update; a bucket waits), started (``start``: a bucket waits),
    open (``run``: buckets load), ended (``run`` returned or raised: a bucket fails at
    once, naming why); ``finish`` goes back to idle.
    """

    def __init__(self, name: str, wait: float) -> None:
        self.name = name
        self.wait = wait
        self._cond = threading.Condition()
        self._state = _IDLE
        self._jobs: deque[_Job] = deque()
        self._committed: int | None = None  # the version committed since start()
        self._failure: str | None = None  # the receiver's reason, since start()
        self._stopped: str | None = None  # the receiver serves no more: why
        self._ended_why = ""
        self._deadline = 0.0

    # -- the receiver's side (its thread) -------------------------------------------------
    def load(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Hand ``items`` to the update's thread; return once loaded (raise if not)."""
        with self._cond:
            if self._state != _OPEN:
                self._cond.wait_for(lambda: self._state in (_OPEN, _ENDED), self.wait)
            if self._state == _ENDED:
                raise GateError(
                    f"a bucket came after update_weights ended ({self._ended_why}); "
                    "nothing of it was loaded"
                )
            if self._state != _OPEN:
                raise GateError(
                    f"a bucket waited {self.wait:g} s for update_weights, which never came "
                    "(push only between start_weight_update and finish_weight_update, "
                    "with update_weights in flight: the trainer-side engine's "
                    "send_weights does this)"
                )
            job = _Job(items)
            self._jobs.append(job)
            self._cond.notify_all()
            bound = max(0.0, self._deadline - time.monotonic()) + 30.0
            if not self._cond.wait_for(lambda: job.done, bound):
                raise GateError(f"a bucket was not loaded within {bound:.0f} s")
        if job.error is not None:
            raise job.error

    def committed(self, version: int) -> None:
        with self._cond:
            self._committed = version
            self._cond.notify_all()

    def failed(self, reason: str, final: bool = False) -> None:
        """The receiver's ``on_failure``: a push failed (``final``: the receiver serves
        no more)."""
        with self._cond:
            if final:
                self._stopped = reason
            elif self._failure is None:
                self._failure = reason
            self._cond.notify_all()

    # -- the worker's side ------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            self._state = _STARTED
            self._committed = self._failure = None
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._state = _IDLE
            self._committed = self._failure = None
            self._cond.notify_all()

    def run(
        self, version: int | None, timeout: float, load: Callable[[list[tuple[str, Any]]], None]
    ) -> int:
        """Open the gate, ``load`` each bucket the receiver hands over (on this thread),
        and return the version committed once the receiver committed ``version`` (None:
        any version).

        Raises:
            GateError: the receiver failed (its reason), committed another version, or
                serves no more; or no commit came within ``timeout`` seconds.
        """
        with self._cond:
            self._deadline = time.monotonic() + timeout
            self._state = _OPEN
            self._cond.notify_all()
        why = "it failed"
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda: (
                            bool(self._jobs)
                            or self._committed is not None
                            or self._failure is not None
                            or self._stopped is not None
                        ),
                        max(0.0, self._deadline - time.monotonic()),
                    )
                    job = self._jobs.popleft() if self._jobs else None
                    if job is None:
                        why = self._outcome(version, timeout)
                        if not why:
                            assert self._committed is not None
                            why = f"version {self._committed} committed"
                            return self._committed
                        raise GateError(why)
                try:
                    load(job.items)
                except BaseException as e:
                    job.error = e
                with self._cond:
                    job.done = True
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._state, self._ended_why = _ENDED, why
                for job in self._jobs:
                    job.error, job.done = GateError(f"update_weights ended: {why}"), True
                self._jobs.clear()
                self._cond.notify_all()

    def _outcome(self, version: int | None, timeout: float) -> str:
        """Why the update failed ("" once ``version`` committed), under the lock."""
        if self._failure is not None:
            return f"receiver `{self.name}`: {self._failure}"
        if self._committed is not None:
            if version is None or self._committed == version:
                return ""
            return (
                f"receiver `{self.name}`: expected version {version} committed, got version "
                f"{self._committed} (the trainer pushed another version than update_info's)"
            )
        if self._stopped is not None:
            return f"receiver `{self.name}` serves no more: {self._stopped}"
        what = "a version" if version is None else f"version {version}"
        return (
            f"receiver `{self.name}`: {what} was not committed within {timeout:g} s "
            "(did the trainer push it, to this receiver's group?)"
        )
