"""The asyncio request/reply server over zmq (its clients: ``_clients.py``,
``_sync_client.py``; what they share: ``_channel.py``).

Messages are the codec's frames behind an 8-byte request id (and, on replies, a
status byte). Frames are sent and received with ``copy=False``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ._address import (
    check_address,
    check_bind,
    curve_keys,
    default_address,
    ipc_path,
    remove_socket_file,
)
from ._channel import (
    CONTROL,
    ERR,
    OK,
    SOCKOPTS,
    Releases,
    authenticator,
    log,
    monitor_address,
    peer_pid,
    release_codec,
    shared_context,
    uses_shm,
)
from ._codec import encode
from ._decode import decode
from ._errors import ChannelClosed, WireError
from ._lifecycle import AsyncResource
from .memory._bulk import pack_bulk, unpack_bulk
from .memory._segments import exports

__all__ = ["Handler", "Server"]

Handler = Callable[[Any, bytes], Awaitable[Any]]
"""``await handler(value, peer)`` returns the reply value; an exception becomes a RemoteError."""


class Server(AsyncResource):
    """An asyncio request/reply service on a ROUTER socket.

    Each request runs ``handler`` as its own task, so a request that waits (a
    parked ``get``) does not hold up the others. Bind defaults to 127.0.0.1 on
    a free port; a non-loopback bind needs ``secret`` (CURVE, keys derived from
    it) and raises :class:`SecurityError` without one. Over ipc:// large
    frames travel through shared memory (see ``_bulk.py`` and ``_shm.py``).

    ``forward``: for services that only store values and send them on (storage
    units): requests decode with ``decode(..., forward=True)``, so long str/bytes lists
    stay packed and tensors in shared memory stay references.

    ``tensors=False``: for services whose requests hold plain values only (a
    controller): a request with a tensor, array or packed list is refused before
    anything is built, so a header cannot make it build objects.

    ``on_disconnect(peer)``, if given, is called on the loop when a client that
    sent a request disconnects (closed, died, or silent past the heartbeat):
    a service that parks requests or holds state per client learns it at once.

    Lifecycle: the constructor checks the address; ``await start()`` binds;
    ``await aclose()`` (idempotent) stops serving. ``async with Server(...) as srv``
    starts it and closes it on exit.
    """

    def __init__(
        self,
        handler: Handler,
        address: str | None = None,
        *,
        secret: str | bytes | None = None,
        on_disconnect: Callable[[bytes], None] | None = None,
        forward: bool = False,
        tensors: bool = True,
    ) -> None:
        address = check_address(address or default_address("tcp"))
        self._forward = forward
        self._tensors = tensors
        check_bind(address, secret)
        self._handler = handler
        self._secret = secret
        self._bind = address
        self._shm = uses_shm(address)
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._bg: list[asyncio.Task[None]] = []
        self._peers_by_fd: dict[int, bytes] = {}
        self._monitor: zmq.Socket[bytes] | None = None  # disconnect events (see _disconnects)
        self._on_disconnect = on_disconnect
        self._releases: Releases | None = None
        self._socket_file: str | None = None
        self._closed = False
        self.address = ""

    async def start(self) -> str:
        """Bind and start serving on the running loop; returns the bound address (a second
        call returns it again).

        Raises:
            WireError: the address cannot be bound.
            ChannelClosed: the server was closed.
        """
        if self._closed:
            raise ChannelClosed(f"server {self.address or self._bind} is closed")
        if self._sock is not None:
            return self.address
        ctx = shared_context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        for opt, val in SOCKOPTS.items():
            sock.setsockopt(opt, val)
        if self._secret is not None:
            keys = curve_keys(self._secret)
            domain = "rlferry-" + keys.server_public.decode()
            authenticator(ctx).allow(domain, keys.client_public)
            sock.zap_domain = domain.encode()
            sock.curve_server = True
            sock.curve_secretkey = keys.server_secret
            sock.curve_publickey = keys.server_public
        try:
            sock.bind(self._bind)
        except zmq.ZMQError as e:
            sock.close(0)
            raise WireError(f"bind {self._bind!r}: {e}") from None
        self._sock = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket_file = ipc_path(self.address)
        self._releases = Releases(self._send_release)
        self._bg = [asyncio.ensure_future(self._serve())]
        if self._shm or self._on_disconnect is not None:
            addr = monitor_address()
            sock.monitor(addr, zmq.EVENT_DISCONNECTED)
            # a sync socket, read only by _disconnects: every event is taken in order, also
            # just before a request's socket is mapped to its client
            monitor: zmq.Socket[bytes] = zmq.Context.shadow(ctx).socket(zmq.PAIR)
            monitor.connect(addr)
            self._monitor = monitor
            asyncio.get_running_loop().add_reader(monitor.fileno(), self._disconnects)
        return self.address

    async def _send_release(self, peer: bytes, ids: list[int]) -> None:
        if self._sock is not None:
            try:
                await self._sock.send_multipart([peer, CONTROL, release_codec[0].encode(ids)])
            except zmq.ZMQError:
                log.debug("release to a client that is gone was dropped")

    def _disconnects(self) -> None:
        """Take in every disconnect the monitor reported so far, in order (on the loop: when
        its socket is readable, and before a request's socket is mapped to its client).
        A disconnect names the socket number, which the OS gives the next connection: a
        client that connects as another dies can be handed the dead one's number, and its
        request could be mapped before the old disconnect was read (an awaiting reader
        may hold it unread); the live client was then reported gone."""
        monitor = self._monitor
        while monitor is not None:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError:  # Again: all taken in (or the socket is closing)
                return
            peer = self._peers_by_fd.pop(event["value"], None)
            if peer is not None:
                exports.peer_gone(peer)
                if self._on_disconnect is not None:
                    # a callback's own failure goes to the loop's exception handler (logged)
                    asyncio.get_running_loop().call_soon(self._on_disconnect, peer)

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) < 3:
                log.warning("dropped a message of %d frames (not an rlferry request)", len(frames))
                continue
            if frames[1].bytes == CONTROL:
                self._released(frames[0].bytes, frames[2].bytes)
                continue
            task = asyncio.ensure_future(self._answer(frames))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _released(self, peer: bytes, body: bytes) -> None:
        try:
            exports.release(peer, release_codec[1].decode(body))
        except msgspec.DecodeError:
            log.warning("dropped a malformed release message")

    async def _answer(self, frames: list[zmq.Frame]) -> None:
        peer, rid = frames[0].bytes, frames[1].bytes
        assert self._releases is not None
        try:
            body = frames[3:]
            self._disconnects()  # a disconnect of this socket number is an older client's
            if self._on_disconnect is not None:
                self._peers_by_fd[frames[-1].get(zmq.SRCFD)] = peer
            if frames[2].bytes:
                if not self._shm:
                    raise WireError("malformed message: shared memory offered over a remote socket")
                self._peers_by_fd[frames[-1].get(zmq.SRCFD)] = peer
                releases = self._releases
                body = unpack_bulk(
                    frames[2].bytes,
                    body,
                    peer_pid(frames[-1]),
                    lambda eid: releases.owe(peer, eid),
                )
            value = decode(body, forward=self._forward, tensors=self._tensors)
            del body, frames
            result = await self._handler(value, peer)
            del value  # lets the request's shared memory go back to the client early
            reply, status = encode(result, shared=self._shm), OK
        except asyncio.CancelledError:
            return
        except Exception as e:  # the error travels back to the caller, named
            if not isinstance(e, WireError):
                log.debug("handler raised", exc_info=True)
            reply, status = encode([type(e).__name__, str(e)]), ERR
        desc = b""
        if self._shm:
            desc, reply = pack_bulk(reply, peer)
        if self._sock is None:
            return
        try:
            await self._sock.send_multipart([peer, rid, status, desc, *reply], copy=False)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the client left before its answer
            log.info("reply to a client that is gone was dropped: %s", e)
            exports.peer_gone(peer)

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def aclose(self) -> None:
        """Stop serving; requests in progress are cancelled (their clients see PeerGone).
        An ipc:// server removes its socket file. A second call does nothing."""
        self._closed = True
        for t in [*self._bg, *self._tasks]:
            t.cancel()
        if self._sock is not None:
            if self._monitor is not None:
                asyncio.get_running_loop().remove_reader(self._monitor.fileno())
                self._sock.disable_monitor()
                self._monitor.close(0)
                self._monitor = None
            self._sock.close(0)
            self._sock = None
        if self._socket_file is not None:
            remove_socket_file(self.address)
            self._socket_file = None
