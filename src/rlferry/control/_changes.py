"""How the coordinator waits: on one event, set and replaced at every change.

Every change a waiter may care about (a sample that ended, a new version, an engine that
joins or comes to serve, a close) sets the current event and replaces it with a new one.
A waiter checks what it waits for, then waits on the event it saw, then checks again:
nothing polls, and a change between the check and the wait is never missed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

from ._errors import CoordinatorTimeout, EngineClosed

__all__ = ["Changes"]

T = TypeVar("T")


class Changes:
    """The coordinator's event; ``describe()`` says which engines serve and why the others
    do not (a timeout's message tells it)."""

    def __init__(self, describe: Callable[[], str]) -> None:
        self._describe = describe
        self._changed = asyncio.Event()
        self.closed = False

    def notify(self) -> None:
        """Wake every waiter (each checks again what it waits for)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def until(self, ready: Callable[[], T | None], timeout: float | None, what: str) -> T:
        """Wait until ``ready()`` gives something (not None), at most ``timeout`` seconds.

        Raises:
            EngineClosed: the coordinator closed first.
            CoordinatorTimeout: (a ``TimeoutError``) ``timeout`` passed; the message says
                how many engines serve, and why the others do not.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while (result := ready()) is None:
            if self.closed:
                raise EngineClosed("coordinator", f"closed while waiting for {what}")
            event = self._changed
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CoordinatorTimeout(f"{what}: not within {timeout} s ({self._describe()})")
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                continue  # the loop's check raises with the reason
        return result
