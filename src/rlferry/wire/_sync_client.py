"""The sync client: requests sent and answered in the asking thread, no loop between.

An :class:`~._clients.AsyncClient` driven from another thread costs two thread
hand-offs per message (to the wire loop's thread and back); this client's thread
sends on its own socket and sleeps in ``zmq_poll`` until the reply, its
socket's monitor (a disconnect or a refused handshake ends the wait at once), a
release owed to the server, or :meth:`Client.close` from another thread wakes
it. Every wait is bounded by the request's timeout and, until the first
handshake, by the connect timeout.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import socket
import threading
import time
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from rlferry.errors import RequestError

from ._address import check_address
from ._channel import CONTROL, log, release_codec, shared_context, uses_shm
from ._clients import CONNECT_TIMEOUT, dealer, gone_after, never_answered, reply_value
from ._codec import encode
from ._errors import ChannelClosed, RemoteError, RequestTimeout, WireError
from .memory._bulk import pack_bulk
from .memory._segments import exports

__all__ = ["Client"]

_ids = itertools.count(1)


class Client:
    """A sync client of a :class:`Server`, whose calls do their socket work in the
    calling thread.

    :meth:`request` sends and waits; :meth:`send` and :meth:`wait` split it, so a
    thread may have several requests in flight (``send(value, reply=False)``: the
    reply is dropped when it comes). Threads that share a client take turns: one
    sends or waits at a time. :meth:`close` may come from any thread; it ends a wait
    in progress at once (``ChannelClosed``). Errors as :class:`AsyncClient`'s.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: str | bytes | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.address = check_address(address)
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._shm = uses_shm(self.address)
        self._key = f"server:{id(self)}:{self.address}".encode()  # names the server in exports
        self._lock = threading.Lock()
        self._sock: Any = None
        self._monitor: Any = None
        self._poller: zmq.Poller | None = None
        self._wakes: tuple[socket.socket, socket.socket] | None = None
        self._pending: set[bytes] = set()  # requests whose reply a wait will read
        self._replies: dict[bytes, list[zmq.Frame]] = {}
        self._owed: collections.deque[int] = collections.deque()  # releases, from any thread
        self._connect_by = 0.0
        self._connected = False
        self._gone: Exception | None = None
        self._closing = False
        self._closed = False

    # -- requests -----------------------------------------------------------------------
    def request(self, value: Any, timeout: float | None = None) -> Any:
        """Send ``value``, wait for the reply value (errors: see :meth:`wait`)."""
        return self.wait(self.send(value), timeout)

    def send(self, value: Any, *, reply: bool = True) -> bytes:
        """Send ``value``; returns the id to :meth:`wait` on (``reply=False``: nothing
        waits, the reply is dropped). Raises what a request does before its wait."""
        frames = encode(value, shared=self._shm)
        with self._lock:
            if self._closing:
                raise ChannelClosed(f"client of {self.address} is closed")
            sock = self._connect()
            self._pump(0)  # a handshake or a disconnect since the last call
            if self._gone is not None:  # fail fast until the server is back (zmq reconnects)
                raise self._gone
            desc = b""
            if self._shm:
                desc, frames = pack_bulk(frames, self._key)
            rid = next(_ids).to_bytes(8, "little")
            if reply:
                self._pending.add(rid)
            sock.send_multipart([rid, desc, *frames], copy=False)
            return rid

    def wait(self, rid: bytes, timeout: float | None = None, *, also: Any = None) -> Any:
        """The reply of the request :meth:`send` returned ``rid`` for (``timeout``: seconds,
        None for no limit). Raises as :meth:`AsyncClient.request` does, and ``ValueError``
        for an id whose reply nobody awaits.

        ``also``: a plain socket (or file descriptor) of the caller's whose readability ends the
        wait too: the wait then returns ``None`` (the request's reply stays awaited: wait
        for ``rid`` again), or the reply if it came in the same wake-up."""
        with self._lock:
            frames = self._wait(rid, timeout, interruptible=True, also=also)
        return None if frames is None else reply_value(frames[1:], self._owe)

    def _wait(
        self, rid: bytes, timeout: float | None, interruptible: bool, also: Any = None
    ) -> list[zmq.Frame] | None:
        if rid not in self._pending and rid not in self._replies and not self._closing:
            raise RequestError(
                f"wait: expected the id of a request sent with a reply awaited and not read "
                f"yet, got {rid!r} (each reply is read once; send(..., reply=False) drops it)"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        if also is not None:  # by its number: the poller names a plain socket so
            if not isinstance(also, int) and not hasattr(also, "fileno"):
                raise RequestError(
                    f"wait: also: expected a socket or a file descriptor, got {also!r} (pass "
                    "the socket whose readability should end the wait too)"
                )
            also = also if isinstance(also, int) else also.fileno()
            assert self._poller is not None
            self._poller.register(also, zmq.POLLIN)
        kept = False  # the reply is still awaited (``also`` ended the wait)
        try:
            while rid not in self._replies:
                if interruptible and self._closing:
                    raise ChannelClosed(f"client of {self.address} was closed")
                if self._gone is not None:
                    raise self._gone
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    if not self._connected:
                        raise never_answered(self.address, timeout)
                    raise RequestTimeout(f"no reply from {self.address} within {timeout} s")
                if not self._connected and now >= self._connect_by:
                    self._gone = never_answered(self.address, self._connect_timeout)
                    continue
                connect = None if self._connected else self._connect_by
                ends = [t for t in (deadline, connect) if t is not None]
                if self._pump(min(ends) - now if ends else None, also) and (
                    rid not in self._replies
                ):
                    kept = True
                    return None
            return self._replies.pop(rid)
        finally:
            if also is not None and self._poller is not None:
                self._poller.unregister(also)
            if not kept:
                self._pending.discard(rid)  # a reply that comes later is dropped

    # -- the socket ---------------------------------------------------------------------
    def _connect(self) -> Any:
        if self._sock is not None:
            return self._sock
        sock, monitor = dealer(zmq.Context.shadow(shared_context()), self.address, self._secret)
        wakes = socket.socketpair()
        for w in wakes:
            w.setblocking(False)
        poller = zmq.Poller()
        for s in (sock, monitor, wakes[0]):
            poller.register(s, zmq.POLLIN)
        self._sock, self._monitor, self._poller, self._wakes = sock, monitor, poller, wakes
        self._connect_by = time.monotonic() + self._connect_timeout
        return sock

    def _pump(self, seconds: float | None, also: Any = None) -> bool:
        """Sleep until something comes (at most ``seconds``; None: no limit), then take in
        everything that came: replies, releases, monitor events, wake-ups. Whether
        ``also`` (registered with the poller by the caller) is readable."""
        assert self._poller is not None and self._wakes is not None
        self._flush()
        ms = None if seconds is None else math.ceil(max(0.0, seconds) * 1000)
        ready = dict(self._poller.poll(ms))
        # a plain socket is named by its file descriptor in the poller's answer: the
        # wake-ups must be read, else every later poll returns at once (a thread spinning)
        if self._wakes[0].fileno() in ready:
            with contextlib.suppress(BlockingIOError):  # drained: nothing more to read
                while self._wakes[0].recv(4096):
                    pass
        if self._monitor in ready:
            self._events()
        if self._sock in ready:
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._file(frames)
        self._flush()
        return also is not None and also in ready

    def _events(self) -> None:
        while True:
            try:
                kind = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._gone, self._connected = None, True
                continue
            exports.peer_gone(self._key)
            self._gone = gone_after(kind, self.address, self._secret, self._gone)

    def _file(self, frames: list[zmq.Frame]) -> None:
        rid = frames[0].bytes
        if rid == CONTROL:  # the server let go of memory this client lent it
            try:
                exports.release(self._key, release_codec[1].decode(frames[1].bytes))
            except msgspec.DecodeError:
                log.warning("dropped a malformed release message")
        elif rid in self._pending:
            self._replies[rid] = frames
        else:  # nobody waits (reply=False, or timed out): read, so its shared memory goes back
            try:
                reply_value(frames[1:], self._owe)
            except RemoteError as e:
                log.debug("a reply nobody waited for was an error: %s", e)
            except WireError as e:
                log.warning("dropped a malformed reply: %s", e)

    def _owe(self, eid: int) -> None:
        """A reply's views of the server's memory died (in any thread): release it soon."""
        self._owed.append(eid)
        self._wake()

    def _flush(self) -> None:
        ids = []
        while self._owed:
            ids.append(self._owed.popleft())
        if ids and self._sock is not None:
            self._sock.send_multipart([CONTROL, release_codec[0].encode(ids)])

    def _wake(self) -> None:
        if self._wakes is not None:
            # full: a wake-up is pending anyway; closed: the client is gone, nothing to wake
            with contextlib.suppress(OSError):
                self._wakes[1].send(b"\0")

    # -- the end ------------------------------------------------------------------------
    def close(self, farewell: Any = None, timeout: float = 5.0) -> None:
        """Close the socket; a wait in progress (another thread's) raises
        :class:`ChannelClosed` at once. ``farewell``: a last request, sent first and its
        reply waited for up to ``timeout`` (a goodbye the server must see before the
        socket goes); its failure is logged, not raised."""
        if self._closing:
            return
        self._closing = True
        self._wake()
        with self._lock:
            if farewell is not None and self._sock is not None and self._gone is None:
                try:
                    rid = next(_ids).to_bytes(8, "little")
                    self._pending.add(rid)
                    self._sock.send_multipart([rid, b"", *encode(farewell)], copy=False)
                    frames = self._wait(rid, timeout, interruptible=False)
                    assert frames is not None  # nothing else ends this wait
                    reply_value(frames[1:], self._owe)
                except (WireError, RemoteError) as e:
                    log.info("the farewell to %s got no answer: %s", self.address, e)
            self._closed = True
            exports.peer_gone(self._key)
            if self._sock is not None:
                self._sock.disable_monitor()
                self._monitor.close(0)
                self._sock.close(0)
                self._sock = self._monitor = self._poller = None
            if self._wakes is not None:
                for w in self._wakes:
                    w.close()
            self._replies.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
