"""``rlferry serve engine``: an :class:`HFEngine` in its own process, served over HTTP."""

from __future__ import annotations

import asyncio
import gc
import signal
from typing import Any

__all__ = ["serve_engine"]


def serve_engine(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    name: str | None = None,
    device: Any = None,
    max_batch: int = 64,
) -> None:
    """Load ``model`` (a local directory), serve it until SIGINT/SIGTERM, print
    ``engine URL NAME`` once it answers. The token is checked before the model loads."""
    from rlferry.control import EngineServer

    from .hf import HFEngine

    async def main() -> None:
        engine = HFEngine(model, name=name, device=device, max_batch=max_batch)
        try:
            server = EngineServer(engine, host, port, token=token)
            url = await server.start()
            gc.freeze()  # the model and the libraries: kept for good, not scanned by the GC
            print(f"engine {url} {engine.name}", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            await server.close()
        finally:
            engine.close()

    EngineServer.check_bind(host, token)
    asyncio.run(main())
