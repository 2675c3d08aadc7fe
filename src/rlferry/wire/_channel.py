"""What a :class:`~._server.Server` and its clients share: the process's zmq context and
its authenticator, the socket options, the message format, and the release messages.

A request is the codec's frames behind an 8-byte request id (and a bulk descriptor:
see ``_bulk.py``); a reply adds a status byte. A message whose id is :data:`CONTROL`
is a release: the ids of exports (shared memory lent to the peer) that the peer's
views no longer use.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
import zmq.auth.thread

from .memory._segments import AVAILABLE as SHM_AVAILABLE

__all__ = [
    "CONTROL",
    "ERR",
    "OK",
    "SOCKOPTS",
    "Authenticator",
    "Releases",
    "authenticator",
    "log",
    "monitor_address",
    "peer_pid",
    "release_codec",
    "shared_context",
    "uses_shm",
]

log = logging.getLogger("rlferry.wire")

OK, ERR = b"\x00", b"\x01"
CONTROL = bytes(8)  # request id of a release message
release_codec = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(list[int]))
SOCKOPTS = {
    zmq.HEARTBEAT_IVL: 1000,
    zmq.HEARTBEAT_TIMEOUT: 5000,
    zmq.HEARTBEAT_TTL: 5000,
    zmq.SNDBUF: 4 << 20,
    zmq.RCVBUF: 4 << 20,
}

_context_lock = threading.Lock()
_context: zmq.asyncio.Context | None = None
_auth: Authenticator | None = None


def shared_context() -> zmq.asyncio.Context:
    """The zmq context all rlferry sockets of this process share."""
    global _context
    with _context_lock:
        if _context is None or _context.closed:
            _context = zmq.asyncio.Context(io_threads=2)
        return _context


_forked_away: list[Any] = []  # a parent's context and authenticator, never used (nor ended)


def _forget_after_fork() -> None:
    """A forked child cannot use its parent's zmq context (its I/O threads did not survive
    the fork): it makes its own on first use. The parent's is kept referenced, so that no
    finalizer tries to end it here."""
    global _context, _auth, _context_lock
    _forked_away.extend(x for x in (_context, _auth) if x is not None)
    _context = _auth = None
    _context_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


class Authenticator:
    """The context's ZAP handler: admits a client whose key matches the server's domain."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.allowed: dict[str, bytes] = {}
        self.thread = zmq.auth.thread.ThreadAuthenticator(zmq.Context(shadow=ctx.underlying))
        self.thread.start()

    def allow(self, domain: str, client_public: bytes) -> None:
        self.allowed[domain] = client_public
        self.thread.configure_curve_callback(domain, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        return self.allowed.get(domain) == key


def authenticator(ctx: zmq.asyncio.Context) -> Authenticator:
    """The authenticator of the shared context, started on first use."""
    global _auth
    with _context_lock:
        if _auth is None:
            _auth = Authenticator(ctx)
        return _auth


def monitor_address() -> str:
    """A monitor endpoint of its own. pyzmq's default names it after the socket's fd, and
    a new socket that reuses the fd of one closed a moment ago then collides with the old
    monitor's endpoint, which the reaper has not yet unbound: under load, requests to
    that server were never seen (found with a create/request/close loop beside CPU hogs)."""
    return f"inproc://rlferry-monitor-{uuid.uuid4().hex}"


def uses_shm(address: str) -> bool:
    """Whether large frames to or from ``address`` travel through shared memory."""
    return SHM_AVAILABLE and address.startswith("ipc://")


def peer_pid(frame: zmq.Frame) -> int | None:
    """The sending process's pid, as libzmq reads it from an ipc:// connection."""
    try:
        return int(str(frame.get("Peer-Address")).rsplit(":", 1)[1])
    except (zmq.ZMQError, ValueError, IndexError):
        return None


class Releases:
    """Release messages owed to peers, queued from any thread, sent from the loop."""

    def __init__(self, send: Callable[[bytes, list[int]], Awaitable[None]]) -> None:
        self._loop = asyncio.get_running_loop()
        self._send = send
        self._owed: dict[bytes, list[int]] = {}

    def owe(self, peer: bytes, eid: int) -> None:
        if self._loop.is_closed():
            return  # the process is shutting down: its peers see it disconnect
        self._loop.call_soon_threadsafe(self._add, peer, eid)

    def _add(self, peer: bytes, eid: int) -> None:
        if not self._owed:
            self._loop.call_soon(lambda: asyncio.ensure_future(self._flush()))
        self._owed.setdefault(peer, []).append(eid)

    async def _flush(self) -> None:
        owed, self._owed = self._owed, {}
        for peer, ids in owed.items():
            await self._send(peer, ids)
