"""One background asyncio loop per process, for the sync wrappers over the async core.

Sync clients and embedded services run their sockets on this loop; a sync call
hands a coroutine to it and waits on the resulting future (an event, not a
poll). The loop is made on first use and rebuilt in a forked child.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["WireLoop", "wire_loop"]


class WireLoop:
    """An event loop on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="rlferry-wire", daemon=True
        )
        self._thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        self.loop.run_forever()

    def in_loop(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a future to wait on from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block this thread until it finishes.

        Raises:
            RuntimeError: called from the loop's own thread (it would deadlock).
        """
        if self.in_loop():
            coro.close()
            raise RuntimeError(
                "a sync rlferry call was made from the wire loop's thread; "
                "use the async client inside coroutines"
            )
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise


_lock = threading.Lock()
_instance: WireLoop | None = None


def wire_loop() -> WireLoop:
    """The process's background wire loop, started on first use."""
    global _instance
    if _instance is None:
        with _lock:
            if _instance is None:
                _instance = WireLoop()
    return _instance


def _forget_after_fork() -> None:
    global _instance, _lock
    _instance = None  # the thread did not survive the fork; the child makes its own
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
