"""``EngineServer``: any :class:`~rlferry.control.Engine` served over HTTP (the protocol:
``_http.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from rlferry.errors import RequestError
from rlferry.wire.lowlevel import AsyncResource

from ._engine import Engine, GenerateRequest
from ._errors import EngineClosed, EngineError
from ._http import LENGTH, Abort, Frame, Pause, Transfer, Version, check_token

__all__ = ["EngineServer"]


class EngineServer(AsyncResource):
    """Serve ``engine`` over HTTP on ``host:port`` (port 0: a free one); ``url`` once started.

    Every JSON answer carries ``X-Rlferry-Done-Ns``, the server's ``time.monotonic_ns()``
    when the answer was ready (on one host, the delivery time of a completion).

    Routes: ``POST /generate`` (a :class:`GenerateRequest`, answered with its
    :class:`Completion`), ``POST /generate_many`` (a JSON list of requests, answered as a
    stream of frames: a 4-byte big-endian length, then a msgpack ``Frame``, stamped with
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
        check_token(host, token)
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
        check_token(host, token)

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
            web.post("/pause", self._json(Pause, lambda m: e.pause(m.mode))),
            web.post("/resume", self._call(e.resume)),
            web.get("/is_paused", self._call(e.is_paused)),
            web.post("/abort", self._json(Abort, lambda m: e.abort_requests(m.ids))),
            web.post("/init_weight_transfer",
                     self._json(Transfer, lambda m: e.init_weight_transfer(m.group, m.address))),
            web.post("/start_weight_update", self._call(e.start_weight_update)),
            web.post("/finish_weight_update",
                     self._json(Version, lambda m: e.finish_weight_update(m.version))),
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
                frame = Frame(at=at, done_ns=time.monotonic_ns(), completion=completion)
            except EngineError as err:
                frame = Frame(at=at, done_ns=time.monotonic_ns(), kind="EngineError",
                               message=err.reason, gone=err.gone)  # fmt: skip
            except RequestError as err:
                frame = Frame(at=at, done_ns=time.monotonic_ns(), kind="RequestError",
                               message=str(err))  # fmt: skip
            except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as err:
                frame = Frame(at=at, done_ns=time.monotonic_ns(), kind="RequestError",
                               message=f"{request.path}: request {at}: {err}")  # fmt: skip
            if gone:
                return
            body = encoder.encode(frame)
            try:
                await response.write(LENGTH.pack(len(body)) + body)  # one write: one frame
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

    async def __aenter__(self) -> EngineServer:
        if self._runner is None:
            await self.start()
        return self


def _ok(value: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), content_type="application/json")


def _error(status: int, kind: str, message: str, *, gone: bool = False) -> web.Response:
    body = json.dumps({"error": kind, "message": message, "gone": gone})
    return web.Response(status=status, text=body, content_type="application/json")
