"""How a slot's engine is started again and watched, per launcher: a process of its own
(local) or a Ray actor."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from rlferry.control import RemoteEngine

from ._engines import Ended, Start

__all__ = ["process_slots", "ray_slots"]

FOREVER = 365 * 86400.0  # a watch's bound: as long as the run


def process_slots(procs: Any, start_one: Callable[[int], str]) -> tuple[Start, Ended]:
    """Local launcher: a slot's new engine is a new process (``start_one(i)``: its URL;
    ``procs.engine_of[i]``: its process), lost when the process exits other than as asked
    (``rlferry serve engine`` exits 0 on SIGINT and SIGTERM: a Ctrl-C reaches the engines
    of the run too, which then end with it)."""

    async def start(i: int) -> Any:
        url = await asyncio.to_thread(start_one, i)
        return RemoteEngine(url, name=f"engine{i}")

    async def ended(i: int, handle: Any) -> str | None:
        proc = procs.engine_of[i]
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()

        def wait() -> None:  # a thread of its own: the loop's pool ends with the run
            code = proc.wait()
            with contextlib.suppress(RuntimeError):  # the run's loop closed: none waits
                loop.call_soon_threadsafe(_settle, done, code)

        threading.Thread(target=wait, name=f"rlferry-engine{i}-watch", daemon=True).start()
        code = await done
        if code == 0:  # it stopped on SIGINT or SIGTERM: asked to (a Ctrl-C reaches it too)
            return None
        return f"its process (pid {proc.pid}) exited with code {code}"

    return start, ended


def _settle(future: asyncio.Future[int], code: int) -> None:
    if not future.done():  # a watch cancelled at the run's end is not told
        future.set_result(code)


def ray_slots(actors: Any) -> tuple[Start, Ended]:
    """On Ray: a slot's new engine is its actor once Ray restarted it
    (``RayEngines.restarted``), ended when Ray reports the actor dead."""

    async def start(i: int) -> Any:
        return await actors.restarted(i)

    async def ended(i: int, handle: Any) -> str:
        return f"actor `{handle.actor_name}` died: {await handle.ended(FOREVER)}"

    return start, ended
