"""Engines over HTTP: :class:`EngineServer` serves any :class:`Engine`, :class:`RemoteEngine`
drives one by URL. JSON bodies encoded by msgspec (never pickle).

:class:`RemoteEngine` sends the requests made in one turn of the event loop as one
``POST /generate_many`` (the demo's coordinator starts a GRPO group's samples at once);
the server answers as a stream of frames, each completion pushed the moment its request
ends, in the order they end: the coordinator awaits each, nothing polls, and one HTTP
exchange carries many samples (one exchange a sample took 12 of a CPU demo step's 130 ms
in the driver). ``POST /generate`` answers one request with its completion, for any HTTP
client. A server that dies fails its requests in flight at once (the connection closes),
as :class:`EngineError`; a request the engine refuses fails alone.

A server binds 127.0.0.1 unless told otherwise; any other bind needs a ``token`` (16
bytes or more), which every request must carry (``Authorization: Bearer TOKEN``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import struct
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiohttp
import msgspec
from aiohttp import web

from rlferry.errors import RequestError
from rlferry.wire import SecurityError

from ._engine import (
    Completion,
    Engine,
    EngineClosed,
    EngineError,
    EngineGone,
    EngineStatistics,
    GenerateRequest,
    PauseMode,
)

__all__ = ["EngineServer", "RemoteEngine"]

T = TypeVar("T")
CONTROL_TIMEOUT = 60.0  # a control call (pause, finish_weight_update, ...) answers within this
CONNECT_TIMEOUT = 10.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class _Pause(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    mode: PauseMode = "keep"


class _Abort(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ids: list[str] | None = None


class _Transfer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    group: str
    address: str


class _Version(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int


class _Frame(msgspec.Struct, frozen=True, kw_only=True):
    """One ended request of a ``/generate_many`` stream: ``at`` is its place in the body's
    list; ``completion``, or the error that failed it (``kind`` as in an error answer)."""

    at: int
    done_ns: int
    completion: Completion | None = None
    kind: str = ""
    message: str = ""
    gone: bool = False


_LENGTH = struct.Struct(">I")  # a frame's length, before its msgpack bytes
_FRAME_DECODER = msgspec.msgpack.Decoder(_Frame)


def _check_token(host: str, token: str | None) -> None:
    if token is not None and len(token.encode()) < 16:
        raise SecurityError(
            f"token: expected at least 16 bytes, got {len(token.encode())} "
            "(use e.g. `openssl rand -hex 32`)"
        )
    if token is None and host not in _LOOPBACK:
        raise SecurityError(
            f"bind {host!r}: an engine server off loopback needs a token (pass token=..., the "
            "same on the coordinator's RemoteEngine; or bind 127.0.0.1)"
        )


class EngineServer:
    """Serve ``engine`` over HTTP on ``host:port`` (port 0: a free one); ``url`` once started.

    Every JSON answer carries ``X-Rlferry-Done-Ns``, the server's ``time.monotonic_ns()``
    when the answer was ready (on one host, the delivery time of a completion).

    Routes: ``POST /generate`` (a :class:`GenerateRequest`, answered with its
    :class:`Completion`), ``POST /generate_many`` (a JSON list of requests, answered as a
    stream of frames: a 4-byte big-endian length, then a msgpack ``_Frame``, stamped with
    ``done_ns`` likewise), ``POST /pause`` (``{"mode": ...}``), ``POST /resume``, ``GET
    /is_paused``, ``POST /abort`` (``{"ids": [...] | null}``), ``POST
    /init_weight_transfer``, ``POST /start_weight_update``, ``POST /finish_weight_update``
    (``{"version": v}``), ``GET /weight_version``, ``GET /statistics``, and ``GET
    /fingerprint`` for an engine that has one (``HFEngine``).

    End of life: :meth:`aclose` (or ``async with``, which starts it too) stops serving;
    the engine itself stays open (it is the caller's). A start after it raises
    :class:`EngineClosed`.
    """

    def __init__(
        self, engine: Engine, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None
    ) -> None:
        _check_token(host, token)
        self.engine = engine
        self.host, self.port = host, port
        self._token = token
        self._runner: web.AppRunner | None = None
        self._closed = False
        self.url = ""

    @staticmethod
    def check_bind(host: str, token: str | None) -> None:
        """Raise :class:`~rlferry.wire.SecurityError` for a bind that would need a token it
        lacks, or a token too short (what the constructor checks), before anything starts."""
        _check_token(host, token)

    async def start(self) -> str:
        """Bind and serve; the URL it serves at (also :attr:`url`).

        Raises:
            EngineClosed: the server was closed (make a new one).
        """
        if self._closed:
            raise EngineClosed(
                self.engine.name, "EngineServer.start after aclose() (make a new EngineServer)"
            )
        app = web.Application(middlewares=[self._guard], client_max_size=64 << 20)
        e = self.engine
        app.add_routes([
            web.post("/generate", self._json(GenerateRequest, e.generate)),
            web.post("/generate_many", self._generate_many),
            web.post("/pause", self._json(_Pause, lambda m: e.pause(m.mode))),
            web.post("/resume", self._call(e.resume)),
            web.get("/is_paused", self._call(e.is_paused)),
            web.post("/abort", self._json(_Abort, lambda m: e.abort_requests(m.ids))),
            web.post("/init_weight_transfer",
                     self._json(_Transfer, lambda m: e.init_weight_transfer(m.group, m.address))),
            web.post("/start_weight_update", self._call(e.start_weight_update)),
            web.post("/finish_weight_update",
                     self._json(_Version, lambda m: e.finish_weight_update(m.version))),
            web.get("/weight_version", self._call(e.get_weight_version)),
            web.get("/statistics", self._call(e.statistics)),
        ])  # fmt: skip
        digest = getattr(e, "fingerprint", None)  # optional: HFEngine has it
        if digest is not None:
            app.add_routes([web.get("/fingerprint", self._call(digest))])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = self._runner.addresses[0][1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}"
        return self.url

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self._token is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode()):
                return _error(401, "SecurityError", "a request without this server's token")
        try:
            return await handler(request)
        except EngineError as err:
            return _error(409, "EngineError", err.reason, gone=err.gone)
        except RequestError as err:  # the engine's own message: the same as in process
            return _error(400, "RequestError", str(err))
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as err:
            return _error(400, "ValueError", f"{request.path}: {err}")

    @staticmethod
    def _json(kind: Any, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            answer = await fn(msgspec.json.decode(body or b"{}", type=kind))
            done = time.monotonic_ns()  # when the answer was ready: delivery is measurable
            response = _ok(answer)
            response.headers["X-Rlferry-Done-Ns"] = str(done)
            return response

        return handle

    async def _generate_many(self, request: web.Request) -> web.StreamResponse:
        """Every request of the body runs as its own ``generate``; each frame is written
        the moment its request ends. A request that fails fails alone (its frame says
        why); a body that is not a list fails whole, before anything runs. A client that
        went away gets no more frames (aiohttp cancels this handler when it sees the
        connection close: the engine aborts the requests still running)."""
        items = msgspec.json.decode(await request.read() or b"null", type=list[msgspec.Raw])
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        encoder = msgspec.msgpack.Encoder()

        async def one(at: int, raw: msgspec.Raw) -> None:
            try:
                completion = await self.engine.generate(
                    msgspec.json.decode(raw, type=GenerateRequest)
                )
                frame = _Frame(at=at, done_ns=time.monotonic_ns(), completion=completion)
            except EngineError as err:
                frame = _Frame(at=at, done_ns=time.monotonic_ns(), kind="EngineError",
                               message=err.reason, gone=err.gone)  # fmt: skip
            except RequestError as err:
                frame = _Frame(at=at, done_ns=time.monotonic_ns(), kind="RequestError",
                               message=str(err))  # fmt: skip
            except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as err:
                frame = _Frame(at=at, done_ns=time.monotonic_ns(), kind="RequestError",
                               message=f"{request.path}: request {at}: {err}")  # fmt: skip
            if gone:
                return
            body = encoder.encode(frame)
            try:
                await response.write(_LENGTH.pack(len(body)) + body)  # one write: one frame
            except ConnectionResetError:  # the client went away: nobody reads the rest
                gone.append(at)

        gone: list[int] = []
        await asyncio.gather(*(one(at, raw) for at, raw in enumerate(items)))
        if not gone:
            with contextlib.suppress(ConnectionResetError):  # it went away after the last
                await response.write_eof()
        return response

    @staticmethod
    def _call(fn: Callable[[], Awaitable[Any]]) -> Any:
        async def handle(request: web.Request) -> web.Response:
            return _ok(await fn())

        return handle

    async def aclose(self) -> None:
        """Stop serving (the engine stays open); a second call does nothing."""
        self._closed = True
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def close(self) -> None:
        """Deprecated: ``await server.aclose()`` (or ``async with``)."""
        warnings.warn(
            "EngineServer.close() is deprecated: use `await server.aclose()` (or `async with "
            "EngineServer(...)`)",
            DeprecationWarning,
            stacklevel=2,
        )
        await self.aclose()

    async def __aenter__(self) -> EngineServer:
        if self._runner is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _ok(value: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), content_type="application/json")


def _error(status: int, kind: str, message: str, *, gone: bool = False) -> web.Response:
    body = json.dumps({"error": kind, "message": message, "gone": gone})
    return web.Response(status=status, text=body, content_type="application/json")


class RemoteEngine:
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
                while left:
                    (size,) = _LENGTH.unpack(await resp.content.readexactly(_LENGTH.size))
                    frame = _FRAME_DECODER.decode(await resp.content.readexactly(size))
                    future = left.pop(frame.at)
                    if future.done():  # its caller stopped waiting (cancelled)
                        continue
                    if frame.completion is not None:
                        future.set_result(frame.completion)
                    elif frame.kind == "RequestError":
                        future.set_exception(RequestError(frame.message, self.name))
                    else:
                        future.set_exception((EngineGone if frame.gone else EngineError)(
                            self.name, f"{path}: {frame.kind}: {frame.message}"
                        ))  # fmt: skip
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

    def _closed_error(self, path: str) -> EngineClosed:
        return EngineClosed(self.name, f"{path}: this RemoteEngine was closed (aclose())")

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self._request("POST", "/pause", _Pause(mode))

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool(await self._request("GET", "/is_paused"))

    async def abort_requests(self, ids: Sequence[str] | None = None) -> int:
        return int(
            await self._request("POST", "/abort", _Abort(None if ids is None else list(ids)))
        )

    async def init_weight_transfer(self, group: str, address: str) -> None:
        await self._request("POST", "/init_weight_transfer", _Transfer(group, address))

    async def start_weight_update(self) -> None:
        await self._request("POST", "/start_weight_update")

    async def finish_weight_update(self, version: int) -> None:
        await self._request("POST", "/finish_weight_update", _Version(version))

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

    async def close(self) -> None:
        """Deprecated: ``await engine.aclose()`` (or ``async with``)."""
        warnings.warn(
            "RemoteEngine.close() is deprecated: use `await engine.aclose()` (or `async with "
            "RemoteEngine(...)`)",
            DeprecationWarning,
            stacklevel=2,
        )
        await self.aclose()

    async def __aenter__(self) -> RemoteEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
