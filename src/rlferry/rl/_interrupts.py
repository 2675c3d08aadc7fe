"""Ctrl-C for the demo: an interrupt is told as one, even when the run failed first."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["run_hearing_ctrl_c"]


def run_hearing_ctrl_c(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """``asyncio.run(main())``, where a Ctrl-C raises KeyboardInterrupt even if the run
    failed otherwise first. A Ctrl-C at a terminal reaches the whole process group: the
    engine processes stop at once, and the run may fail on one of them (unreachable, on
    a loaded machine) before asyncio cancels it; it is an interrupt all the same. The
    SIGINT handler asyncio installs is chained: a Ctrl-C is noted, then handled as
    asyncio does (the run cancelled, its clean-up run)."""
    heard = threading.Event()
    ours: list[Any] = []

    async def hearing() -> Any:
        theirs = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread() and callable(theirs):

            def note(signum: int, frame: Any) -> None:
                heard.set()
                theirs(signum, frame)

            ours.append(note)
            signal.signal(signal.SIGINT, note)
        return await main()

    try:
        return asyncio.run(hearing())
    except Exception as e:
        if heard.is_set():
            raise KeyboardInterrupt(f"the run also failed: {type(e).__name__}: {e}") from e
        raise
    finally:
        if ours and signal.getsignal(signal.SIGINT) is ours[0]:
            signal.signal(signal.SIGINT, signal.default_int_handler)
