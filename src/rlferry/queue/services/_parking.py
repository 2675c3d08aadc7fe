"""Requests parked until the controller's state lets them through: woken by an event on
every change, never by polling, and kept per client, so that a client that disconnects
takes its parked requests with it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["Parking"]

T = TypeVar("T")


class Parking:
    """Where requests that may wait are parked (one per asyncio task)."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()  # set and replaced on every change waiters care about
        self._parked: dict[bytes, set[asyncio.Task[Any]]] = {}  # per client: waiting requests

    async def serve(self, peer: bytes, request: Coroutine[Any, Any, T]) -> T:
        """Serve a request that may wait, as part of ``peer``'s parked requests."""
        task = asyncio.current_task()
        assert task is not None
        parked = self._parked.setdefault(peer, set())
        parked.add(task)
        try:
            return await request
        finally:
            parked.discard(task)
            if not parked:
                self._parked.pop(peer, None)

    def disconnected(self, peer: bytes) -> None:
        """A client disconnected (closed, died): its parked requests go, unanswered."""
        for task in self._parked.pop(peer, ()):
            task.cancel()

    def changed(self) -> None:
        """The state changed: every waiter looks again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def until(self, ready: Callable[[], T | None], timeout: float | None) -> T:
        """Wait, on events, until ``ready()`` returns something other than None.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while (result := ready()) is None:
            event = self._changed
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                raise TimeoutError from None
        return result
