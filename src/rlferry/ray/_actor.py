"""An engine actor: an ``HFEngine`` or a ``VLLMEngine`` served over rlferry's HTTP
:class:`~rlferry.control.EngineServer` from a Ray actor, on the node's address, with the
token of its job."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from rlferry.control import EngineServer
from rlferry.wire import is_local, wire_loop

from ._common import Watched, node_address, where

__all__ = ["EngineActor", "probe"]


class EngineActor(Watched):
    """An engine served over HTTP from a Ray actor. Everything starts in the constructor,
    so an actor that Ray restarts (``max_restarts``) serves again by itself, at a new
    port, at the checkpoint's weights (version 0)."""

    def __init__(self, kind: str, model: str, name: str, token: str, options: dict[str, Any]):
        super().__init__()
        if kind == "vllm":
            from rlferry.engines.vllm import VLLMEngine

            async def build() -> Any:  # vLLM's AsyncLLM belongs to the loop it is made on
                return VLLMEngine(model, name=name, **options)

            self._engine: Any = wire_loop().run(build())
        else:
            from rlferry.engines.hf import HFEngine

            self._engine = HFEngine(model, name=name, **options)
        self._token = token
        self._server = EngineServer(_Joining(self._engine, token), node_address(), 0, token=token)
        self._url = wire_loop().run(self._server.start())
        gc.freeze()  # the model and the libraries: kept for good, not scanned by the GC

    def url(self) -> str:
        return str(self._url)

    def weights_secret(self) -> str:
        """The secret of the job's weight senders (see :func:`weight_sender`)."""
        return str(self._token)

    async def close(self) -> None:
        """Stop serving and close the engine (the launcher's call to every actor)."""
        await asyncio.wrap_future(wire_loop().submit(self._server.aclose()))
        await asyncio.wrap_future(wire_loop().submit(self._engine.aclose()))
        self._closed.set()


class _Joining:
    """The engine as its server serves it: it joins a trainer's sender off this host (a
    tcp:// address that is not loopback) with the job's secret, others without."""

    def __init__(self, engine: Any, secret: str) -> None:
        self._engine = engine
        self._secret = secret

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def init_weight_transfer(self, group: str, address: str) -> None:
        key = None if is_local(address) else self._secret
        await self._engine.init_weight_transfer(group, address, secret=key)


def probe() -> dict[str, Any]:
    """Where a task of a bundle runs (its node, GPUs): the launcher orders the bundles by it."""
    return where()
