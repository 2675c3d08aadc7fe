"""``RemoteEngine``: an :class:`~rlferry.control.Engine` served elsewhere by an
``EngineServer``, driven by URL (the protocol: ``_http.py``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, TypeVar

import aiohttp
import msgspec

from rlferry.errors import RequestError
from rlferry.wire import SecurityError
from rlferry.wire.lowlevel import AsyncResource

from ._engine import Completion, EngineStatistics, GenerateRequest, PauseMode
from ._errors import EngineClosed, EngineError, EngineGone
from ._http import Abort, Frame, Pause, Transfer, Version, split_frames

__all__ = ["CONNECT_TIMEOUT", "CONTROL_TIMEOUT", "RemoteEngine"]

T = TypeVar("T")
CONTROL_TIMEOUT = 60.0  # a control call (pause, finish_weight_update, ...) answers within this
CONNECT_TIMEOUT = 10.0


class RemoteEngine(AsyncResource):
    """An :class:`Engine` served elsewhere by :class:`EngineServer` (``rlferry serve engine``).

    ``name``: how the coordinator and the trainer's ``WeightSender`` know it (default: the
    URL). Every failure is an :class:`EngineError` naming it: unreachable, gone mid-request
    (at once: the connection closes), or an error of the engine.

    End of life: :meth:`aclose` (or ``async with``) closes its HTTP client (the engine
    serves on); the calls in flight and every later one raise :class:`EngineClosed`.
    """

    def __init__(self, url: str, *, token: str | None = None, name: str | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise RequestError(f"url: expected http://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self.name = name or self.url
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None
        # generate() calls of this turn of the event loop, sent together at its end
        self._batch: list[tuple[GenerateRequest, asyncio.Future[Completion]]] = []
        self._streams: set[asyncio.Task[None]] = set()
        self._closed = False

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection limit: every generate in flight holds a connection until its
            # completion, and a control call (pause, statistics) must never queue behind
            # them (aiohttp's default pool of 100 made a pause wait for hundreds of
            # completions while the coordinator kept more samples in flight).
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT),
            )
        return self._session

    async def _request(
        self, method: str, path: str, body: Any = None, kind: type[T] | None = None,
        timeout: float | None = CONTROL_TIMEOUT,
    ) -> Any:  # fmt: skip
        if self._closed:
            raise self._closed_error(path)
        data = msgspec.json.encode(body) if body is not None else None
        limit = aiohttp.ClientTimeout(total=timeout, sock_connect=CONNECT_TIMEOUT)
        try:
            async with self._client().request(
                method, self.url + path, data=data, timeout=limit,
                headers={"Content-Type": "application/json"},
            ) as resp:  # fmt: skip
                raw = await resp.read()
                if resp.status != 200:
                    raise self._refused(path, resp.status, raw)
                return msgspec.json.decode(raw, type=kind) if kind else msgspec.json.decode(raw)
        except asyncio.TimeoutError:
            raise EngineGone(self.name, f"{path}: no answer within {timeout} s") from None
        except aiohttp.ClientConnectorError as e:
            raise EngineGone(self.name, f"{path}: unreachable ({e.os_error or e})") from None
        except aiohttp.ClientError as e:
            raise EngineGone(
                self.name, f"{path}: the engine went away ({type(e).__name__}: {e})"
            ) from None

    def _refused(self, path: str, status: int, raw: bytes) -> Exception:
        """The error of an answer other than 200: the request's fault (400: ``RequestError``
        with the engine's message), a refused token (``SecurityError``), or the engine's
        (``EngineError``)."""
        try:
            err = json.loads(raw)
            kind, message, gone = err["error"], err["message"], bool(err.get("gone"))
        except (ValueError, KeyError, TypeError):
            kind, message, gone = "", f"HTTP {status}: {raw[:200]!r}", False
        if status == 401:
            what = (
                "refused this client's token (pass token= the one the server was started "
                "with, its --token)"
                if self._headers
                else "needs a token and this client has none (pass token= the server's --token)"
            )
            return SecurityError(f"engine `{self.name}`: {path}: the server {what}")
        if status == 400:
            return RequestError(message, self.name)
        return (EngineGone if gone else EngineError)(
            self.name, f"{path}: {kind + ': ' if kind else ''}{message}"
        )

    async def generate(self, request: GenerateRequest) -> Completion:
        """``request``'s completion. The calls made in one turn of the event loop travel
        as one ``/generate_many`` exchange; each returns when its own request ends."""
        if self._closed:
            raise self._closed_error("/generate_many")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Completion] = loop.create_future()
        self._batch.append((request, future))
        if len(self._batch) == 1:
            loop.call_soon(self._send_batch)
        return await future

    def _send_batch(self) -> None:
        batch, self._batch = self._batch, []
        if not batch:  # closed since: its callers were told
            return
        task = asyncio.ensure_future(self._stream(batch))
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)

    async def _stream(
        self, batch: list[tuple[GenerateRequest, asyncio.Future[Completion]]]
    ) -> None:
        path = "/generate_many"
        left = dict(enumerate(future for _, future in batch))
        try:
            async with self._client().post(
                self.url + path, data=msgspec.json.encode([r for r, _ in batch]),
                headers={"Content-Type": "application/json"},
            ) as resp:  # fmt: skip
                if resp.status != 200:
                    raw = await resp.read()
                    for future in left.values():
                        if not future.done():
                            future.set_exception(self._refused(path, resp.status, raw))
                    return
                buf = bytearray()
                while left:
                    got = await resp.content.readany()
                    if not got:  # the stream ended before every request did
                        raise asyncio.IncompleteReadError(bytes(buf), None)
                    buf += got
                    frames, used = split_frames(buf)
                    del buf[:used]
                    for frame in frames:
                        self._ended(frame, left.pop(frame.at), path)
        except (aiohttp.ClientError, asyncio.IncompleteReadError, msgspec.DecodeError,
                KeyError, OSError) as e:  # fmt: skip
            why = (
                f"unreachable ({e.os_error or e})"
                if isinstance(e, aiohttp.ClientConnectorError)
                else f"the engine went away ({type(e).__name__}: {e})"
            )
            for future in left.values():
                if not future.done():
                    future.set_exception(EngineGone(self.name, f"{path}: {why}"))
        finally:  # cancelled by aclose(): its callers are told, never left waiting
            for future in left.values():
                if not future.done():
                    future.set_exception(self._closed_error(path))

    def _ended(self, frame: Frame, future: asyncio.Future[Completion], path: str) -> None:
        """Resolve a request's ``future`` with its frame's completion or error."""
        if future.done():  # its caller stopped waiting (cancelled)
            return
        if frame.completion is not None:
            future.set_result(frame.completion)
        elif frame.kind == "RequestError":
            future.set_exception(RequestError(frame.message, self.name))
        else:
            future.set_exception((EngineGone if frame.gone else EngineError)(
                self.name, f"{path}: {frame.kind}: {frame.message}"
            ))  # fmt: skip

    def _closed_error(self, path: str) -> EngineClosed:
        return EngineClosed(self.name, f"{path}: this RemoteEngine was closed (aclose())")

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self._request("POST", "/pause", Pause(mode))

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool(await self._request("GET", "/is_paused"))

    async def abort_requests(self, ids: Sequence[str] | None = None) -> int:
        return int(await self._request("POST", "/abort", Abort(None if ids is None else list(ids))))

    async def init_weight_transfer(self, group: str, address: str) -> None:
        await self._request("POST", "/init_weight_transfer", Transfer(group, address))

    async def start_weight_update(self) -> None:
        await self._request("POST", "/start_weight_update")

    async def finish_weight_update(self, version: int) -> None:
        await self._request("POST", "/finish_weight_update", Version(version))

    async def get_weight_version(self) -> int | None:
        value = await self._request("GET", "/weight_version")
        return None if value is None else int(value)

    async def fingerprint(self) -> str:
        """The engine's :func:`rlferry.weights.fingerprint` (engines that have one)."""
        return str(await self._request("GET", "/fingerprint", timeout=600))

    async def statistics(self) -> EngineStatistics:
        out: EngineStatistics = await self._request("GET", "/statistics", kind=EngineStatistics)
        return out

    async def aclose(self) -> None:
        """Close the HTTP client (the engine serves on): the calls in flight and every later
        one raise :class:`EngineClosed`. A second call does nothing."""
        self._closed = True
        for task in list(self._streams):
            task.cancel()
        for _, future in self._batch:
            if not future.done():
                future.set_exception(self._closed_error("/generate_many"))
        self._batch = []
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
