"""A trainer rank's pushes, each on a thread of its own: the rank's pipe stays free for its
next command.

In an asynchronous run the driver sends a step's train command while the update before it is
still pushing: the rank gets its batch from the queue while its push runs (``Pushes.start``),
then waits for the driver's ``("go",)`` (the update done: every engine loaded what it was
sent) before its step changes the weights the engines read. A push answers from its thread;
:meth:`Pushes.send` is the rank's one way to answer, so two answers never interleave.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from rlferry.weights import WeightSyncError

__all__ = ["Pushes"]


class Pushes:
    """Rank ``rank``'s pushes through ``push(version, seconds) -> bytes sent``, answered on
    ``conn``; one at a time (a push waits for the one before it)."""

    def __init__(
        self, rank: int, conn: Any, push: Callable[[int, float], int], device: torch.device
    ) -> None:
        self._rank, self._conn, self._push, self._device = rank, conn, push, device
        self._sending = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def send(self, message: tuple[Any, ...]) -> None:
        """Answer the driver (from any of the rank's threads)."""
        with self._sending:
            self._conn.send(message)

    def start(self, version: int, seconds: float) -> None:
        """Push ``version`` on a thread, once the push before it ended; it answers
        ``("ok", {"seconds", "bytes"})`` or ``("error", why)`` when the engines loaded it or
        it failed."""
        self.join()
        self._thread = threading.Thread(
            target=self._run, args=(version, seconds), name=f"rlferry-push-{self._rank}",
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    def _run(self, version: int, seconds: float) -> None:
        if self._device.type == "cuda":  # the rank's device (a thread starts on GPU 0)
            torch.cuda.set_device(self._device)
        t0 = time.perf_counter()
        try:
            sent = self._push(version, seconds)
        except WeightSyncError as e:  # an engine lost mid-push: the update's to judge
            self.send(("error", f"trainer rank {self._rank}: {type(e).__name__}: {e}"))
            return
        except BaseException as e:  # the rank's own failure: it ends the rank (see join)
            self._failure = e
            self.send(("error", f"trainer rank {self._rank}: {type(e).__name__}: {e}\n"
                                f"{traceback.format_exc(limit=6)}"))  # fmt: skip
            return
        self.send(("ok", {"seconds": time.perf_counter() - t0, "bytes": sent}))

    def join(self) -> None:
        """Return once no push runs; a push that failed other than by an engine's loss
        raises its error here (the rank ends with it)."""
        self.wait()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def wait(self) -> None:
        """Return once no push runs (the rank is ending: a push's failure was answered)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def hold(self) -> bool:
        """Wait for the driver's ``("go",)`` (the update in flight done), starting the pushes
        it sends meanwhile (an update pushed again once a lost engine was replaced); then
        return once no push runs. False: the driver said ``("stop",)``."""
        while True:
            cmd = self._conn.recv()
            if cmd[0] == "go":
                self.join()
                return True
            if cmd[0] == "stop":
                self.join()
                return False
            if cmd[0] != "push":
                raise RuntimeError(
                    f"trainer rank {self._rank}: expected 'go' or 'push' while its step waits "
                    f"for the update in flight, got {cmd[0]!r}"
                )
            self.start(cmd[1], cmd[2])
