"""The HTTP JSON client of the engine adapters that drive a server (SGLang, vLLM)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from rlferry.control import EngineClosed, EngineError, EngineGone, RequestError
from rlferry.wire import SecurityError

__all__ = ["JsonClient"]


class JsonClient:
    """JSON calls to an engine server at ``url``. A 400 or 422 answer is the request's
    fault (``RequestError`` with the server's text; the engine keeps serving), 401 or 403
    a refused token (``SecurityError``); every other failure is an ``EngineError`` naming
    ``name`` (``gone`` when no answer came: none in time, unreachable, connection lost).

    No connection limit: a generate holds its connection until its completion, and a
    control call (pause, weights) must never queue behind them (aiohttp's default pool
    of 100 made a pause wait for hundreds of completions). No keep-alive: a server that
    closes a connection after an error answer would fail the next request on it with a
    reset. After :meth:`aclose`, every call raises ``EngineClosed``."""

    def __init__(self, name: str, url: str, headers: dict[str, str] | None = None) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self._headers = headers or {}
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    async def call(
        self, method: str, path: str, body: Any = None, *, timeout: float | None,
        params: dict[str, str] | None = None,
    ) -> Any:  # fmt: skip
        """The decoded JSON answer (None for an empty one)."""
        if self._closed:
            raise EngineClosed(self.name, f"{path}: this engine was closed (aclose())")
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True), headers=self._headers
            )
        limit = aiohttp.ClientTimeout(total=timeout, sock_connect=10.0)
        try:
            async with self._session.request(
                method, self.url + path, json=body, params=params, timeout=limit
            ) as resp:
                raw = await resp.read()
                if resp.status in (400, 422):
                    text = raw[:500].decode(errors="replace")
                    raise RequestError(f"{path}: the server refused the request: {text}", self.name)
                if resp.status in (401, 403):
                    raise SecurityError(
                        f"engine `{self.name}`: {path}: the server refused this client's token "
                        f"(HTTP {resp.status}; pass the server's API key as token=)"
                    )
                if resp.status != 200:
                    raise EngineError(self.name, f"{path}: HTTP {resp.status}: {raw[:500]!r}")
                return json.loads(raw) if raw else None
        except asyncio.TimeoutError:
            raise EngineGone(self.name, f"{path}: no answer within {timeout} s") from None
        except aiohttp.ClientConnectorError as e:
            raise EngineGone(self.name, f"{path}: unreachable ({e.os_error or e})") from None
        except aiohttp.ClientError as e:
            raise EngineGone(
                self.name, f"{path}: the server went away ({type(e).__name__}: {e})"
            ) from None

    async def aclose(self) -> None:
        """Close the HTTP session (the server keeps running); a second call does nothing."""
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
