"""What changed in a controller and who waits for it: ``get_meta`` waits on events.

A version counts the changes; a waiting thread waits on a condition, a waiting event loop
on a future; every change wakes them all at once. ``Changes`` shares its owner's lock:
``notify`` is called with it held, the waits take it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .._errors import GetMetaTimeout

__all__ = ["Changes"]

T = TypeVar("T")


class Changes:
    """The version of a controller's data and its waiters."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._changed = threading.Condition(lock)
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.version = 0
        """Counts changes, for waiters that wait for the next one (read with the lock held)."""

    def notify(self) -> None:
        """Data changed: wake every waiter (called with the lock held)."""
        self.version += 1
        self._changed.notify_all()
        for loop, fut in self._futures:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_wake, fut)
        self._futures.clear()

    def wait_for(
        self, attempt: Callable[[], T | None], what: Callable[[], str], timeout: float
    ) -> T:
        """``attempt()`` under the lock until it answers, waiting for changes in between.

        Raises:
            GetMetaTimeout: no answer within ``timeout`` s; ``what()`` is its message.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                got = attempt()
                if got is not None:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
        raise GetMetaTimeout(what())

    def wait_change(self, seen: int, timeout: float) -> None:
        """Wait until something changed since the version was ``seen`` (or ``timeout``
        passed: the caller looks again either way)."""
        with self._lock:
            self._changed.wait_for(lambda: self.version != seen, timeout)

    async def async_wait_for(
        self, attempt: Callable[[], T | None], what: Callable[[], str], timeout: float
    ) -> T:
        """``wait_for`` on the caller's event loop (it never blocks the loop while it waits)."""
        got = await self._until(attempt, timeout)
        if got is None:
            raise GetMetaTimeout(what())
        return got

    async def async_wait_change(self, seen: int, timeout: float) -> None:
        """``wait_change`` for a caller on an event loop (a service's parked request)."""
        await self._until(lambda: True if self.version != seen else None, timeout)

    async def _until(self, attempt: Callable[[], T | None], timeout: float) -> T | None:
        """``attempt()`` under the lock until it answers; None once ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                got = attempt()
                if got is not None:
                    return got
                fut: asyncio.Future[None] = loop.create_future()
                self._futures.append((loop, fut))
            left = deadline - time.monotonic()
            try:
                if left > 0:
                    await asyncio.wait([fut], timeout=left)
            finally:  # timed out or cancelled: no change should wake a loop that may be gone
                with self._lock:
                    if (loop, fut) in self._futures:
                        self._futures.remove((loop, fut))
            if left <= 0:
                return None


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
