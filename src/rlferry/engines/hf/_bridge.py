"""Futures of an event loop resolved from the engine's thread."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["Waiter", "settle"]


def settle(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    """Resolve ``future`` on its ``loop`` from any thread (a future already done, say
    cancelled, is left as it is; a closed loop has nobody waiting)."""

    def done() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
        loop.call_soon_threadsafe(done)


class Waiter:
    """A caller waiting for the engine's thread: its loop, its future, what it waits for."""

    __slots__ = ("future", "kind", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, kind: str) -> None:
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()
        self.kind = kind

    @classmethod
    def here(cls, kind: str = "") -> Waiter:
        """A waiter on the running loop."""
        return cls(asyncio.get_running_loop(), kind)

    def resolve(self, value: Any) -> None:
        settle(self.loop, self.future, value)

    def fail(self, error: BaseException) -> None:
        settle(self.loop, self.future, error=error)
