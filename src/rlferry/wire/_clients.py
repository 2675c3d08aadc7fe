"""The asyncio client of a :class:`~._server.Server`, and what it shares with the sync
:class:`~._sync_client.Client`: how a client's socket is made, and how a reply is read.

A request is the codec's frames behind an 8-byte request id; the reply adds a status
byte. A client watches its socket's monitor: when the peer disconnects, every waiting
request fails with :class:`PeerGone` at once instead of waiting out its timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
import zmq.auth.thread
from zmq.utils.monitor import parse_monitor_message

from ._address import (
    check_address,
    curve_keys,
    ipc_path,
)
from ._channel import (
    CONTROL,
    ERR,
    SOCKOPTS,
    Releases,
    log,
    monitor_address,
    peer_pid,
    release_codec,
    shared_context,
    uses_shm,
)
from ._codec import encode
from ._decode import decode
from ._errors import (
    ChannelClosed,
    PeerGone,
    RemoteError,
    RequestTimeout,
    SecurityError,
    WireError,
)
from ._lifecycle import AsyncResource
from .memory._bulk import pack_bulk, unpack_bulk
from .memory._segments import exports

__all__ = ["CONNECT_TIMEOUT", "AsyncClient"]

CONNECT_TIMEOUT = 10.0
"""Seconds a client waits for its first handshake before its requests fail as never answered."""


_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
)


def dealer(ctx: zmq.Context[Any], address: str, secret: str | bytes | None) -> tuple[Any, Any]:
    """A client's socket, connected to ``address``, and its monitor: every client is made
    here (options, CURVE keys from ``secret``); a missing ipc:// socket file fails now."""
    path = ipc_path(address)
    if path is not None and not os.path.exists(path):
        raise PeerGone(
            f"no server at {address}: its socket file does not exist (is the server "
            "running, and is this the address it printed?)"
        )
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for opt, val in SOCKOPTS.items():
        sock.setsockopt(opt, val)
    if secret is not None:
        keys = curve_keys(secret)
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
    monitor = sock.get_monitor_socket(_EVENTS, addr=monitor_address())
    sock.connect(address)
    return sock, monitor


def refusal(kind: int, address: str, secret: object) -> SecurityError | None:
    """The error of a handshake the server refused, or None for a plain disconnect."""
    if kind not in _FAILED:
        return None
    why = (  # the client cannot tell these two apart: the handshake just fails
        "this client's secret differs from the server's, or the server has none "
        "(pass the secret the server was started with, or none)"
    )
    if secret is None:
        why = "the server requires a secret and this client has none (pass secret=)"
    return SecurityError(f"{address} refused this client's handshake: {why}")


def gone_after(kind: int, address: str, secret: object, before: Exception | None) -> Exception:
    """Why requests fail after the monitor's event ``kind`` (a refusal, or a disconnect;
    a refusal stays the reason through the disconnect that follows it)."""
    refused = refusal(kind, address, secret)
    if refused is not None:
        return refused
    if isinstance(before, SecurityError):
        return before
    return PeerGone(f"{address} disconnected (the server closed or died)")


def never_answered(address: str, seconds: float | None) -> PeerGone:
    return PeerGone(
        f"{address} never answered within {seconds:g} s (no server listens there: is it "
        "running, and is this the address it printed?)"
    )


def reply_value(frames: list[Any], owe: Callable[[int], None]) -> Any:
    """The value of a reply's frames (after its id): its views of the server's shared
    memory, if any, owe a release when they die. Raises the handler's error as
    :class:`RemoteError`, a malformed message as :class:`WireError`."""
    body = frames[2:]
    if frames[1].bytes:
        body = unpack_bulk(frames[1].bytes, body, peer_pid(frames[-1]), owe)
    value = decode(body)
    if frames[0].bytes == ERR:
        raise RemoteError(str(value[0]), str(value[1]))
    return value


class AsyncClient(AsyncResource):
    """An asyncio client of a :class:`Server`; many requests may be in flight at once.

    Lifecycle: the constructor checks the address; the first request (or
    :meth:`connect`) connects; ``await aclose()`` (idempotent) closes; ``async with``
    closes on exit.

    End of life: :class:`ChannelClosed` after :meth:`aclose`; :class:`PeerGone`
    when the server disconnects while requests wait, when an ipc:// address has no
    socket file, or when no server answered the connection within
    ``connect_timeout`` seconds (default :data:`CONNECT_TIMEOUT`; later requests
    fail at once until it answers); :class:`SecurityError` when the server refused
    this client's secret (or its lack of one); :class:`RequestTimeout` when no reply
    comes in time; :class:`RemoteError` when the handler raised.
    """

    _ids = itertools.count(1)

    def __init__(
        self,
        address: str,
        *,
        secret: str | bytes | None = None,
        on_state: Callable[[bool], None] | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.address = check_address(address)
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._connected = False  # a handshake succeeded, ever
        self._never: asyncio.TimerHandle | None = None
        self._on_state = on_state  # called (on the loop) with True on connect, False on loss
        self._shm = uses_shm(address)
        self._key = f"server:{id(self)}:{address}".encode()  # names the server in exports
        self._sock: zmq.asyncio.Socket | None = None
        self._pending: dict[bytes, asyncio.Future[Any]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._releases: Releases | None = None
        self._gone: Exception | None = None
        self._closed = False

    def connect(self) -> None:
        """Connect now (else the first request does): ``on_state`` reports from then on."""
        self._connect()

    def _connect(self) -> zmq.asyncio.Socket:
        if self._closed:
            raise ChannelClosed(f"client of {self.address} is closed")
        if self._sock is not None:
            return self._sock
        sock, monitor = dealer(shared_context(), self.address, self._secret)
        self._sock = sock
        self._releases = Releases(self._send_release)
        self._tasks = [
            asyncio.ensure_future(self._read(sock)),
            asyncio.ensure_future(self._watch(monitor)),
        ]
        self._never = asyncio.get_running_loop().call_later(
            self._connect_timeout, self._never_answered
        )
        return sock

    def _never_answered(self) -> None:
        if not self._connected and self._gone is None:
            self._gone = never_answered(self.address, self._connect_timeout)
            self._fail_all(self._gone)

    async def _send_release(self, peer: bytes, ids: list[int]) -> None:
        if self._sock is not None:
            await self._sock.send_multipart([CONTROL, release_codec[0].encode(ids)])

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            self._on_message(frames)
            del frames  # nothing of a message may outlive its handling here: see _on_message

    def _owe(self, eid: int) -> None:
        if self._releases is not None:
            self._releases.owe(self._key, eid)

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        """Hand a reply to its waiter. A function of its own so that its locals (views of
        shared memory) die when it returns, and the releases go out at once."""
        if frames[0].bytes == CONTROL:
            try:
                exports.release(self._key, release_codec[1].decode(frames[1].bytes))
            except msgspec.DecodeError:
                log.warning("dropped a malformed release message")
            return
        fut = self._pending.pop(frames[0].bytes, None)
        if fut is None or fut.done():  # timed out or cancelled meanwhile
            fut = None
        try:
            value = reply_value(frames[1:], self._owe)  # a late reply's views go at once
            if fut is not None:
                fut.set_result(value)
        except (WireError, RemoteError) as e:
            if fut is not None:
                fut.set_exception(e)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                kind = parse_monitor_message(await monitor.recv_multipart())["event"]
                if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._gone, self._connected = None, True
                    if self._never is not None:
                        self._never.cancel()
                    if self._on_state is not None:
                        self._on_state(True)
                    continue
                exports.peer_gone(self._key)
                self._gone = gone_after(kind, self.address, self._secret, self._gone)
                self._fail_all(self._gone)
                if self._on_state is not None:
                    self._on_state(False)
        except (asyncio.CancelledError, zmq.ZMQError):
            return
        finally:
            monitor.close(0)

    def _fail_all(self, exc: Exception) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    async def request(self, value: Any, timeout: float | None = None) -> Any:
        """Send ``value``, wait for the reply value.

        Raises:
            RequestTimeout: no reply within ``timeout`` seconds (None: no limit).
            PeerGone: the server disconnected while we waited, or never answered.
            SecurityError: the server refused this client's secret.
            ChannelClosed: this client was closed.
            RemoteError: the server's handler raised.
            WireError: ``value`` cannot be encoded.
        """
        frames = encode(value, shared=self._shm)
        sock = self._connect()
        if self._gone is not None:  # fail fast until the server is back (zmq reconnects)
            raise self._gone
        desc = b""
        if self._shm:
            desc, frames = pack_bulk(frames, self._key)
        rid = next(self._ids).to_bytes(8, "little")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await sock.send_multipart([rid, desc, *frames], copy=False)
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            if not self._connected:
                raise never_answered(self.address, timeout) from None
            raise RequestTimeout(f"no reply from {self.address} within {timeout} s") from None
        finally:
            self._pending.pop(rid, None)

    async def aclose(self) -> None:
        """Close the socket; waiting requests raise :class:`ChannelClosed`. A second call
        does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._never is not None:
            self._never.cancel()
        self._fail_all(ChannelClosed(f"client of {self.address} was closed"))
        exports.peer_gone(self._key)
        for t in self._tasks:
            t.cancel()
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(0)
            self._sock = None
