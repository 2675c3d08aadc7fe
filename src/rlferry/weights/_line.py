"""The start line: a sender's pushing thread starts its receivers' streams itself.

A push over a collective transport whose receivers hold its plan and group needs one
message before its stream: ``Stream``. Through the control channel it went from the
pushing thread to the wire loop (the begin), from the loop to each receiver's parked
request, and through ZeroMQ's I/O threads of both processes: on four H200s, 2 trainer
ranks to a TP=2 engine at 4.1 GB, the receivers' first receives were posted 0.9-1.0 ms
after the push was called, most of it those hops.

So a receiver also listens on a datagram socket in Linux's abstract namespace
(nothing on disk, this host's network namespace only), named in its ``Join``; the
sender's pushing thread sends ``Stream`` there (one ``sendto`` a receiver, no loop)
and tells its hub after. The receiver's thread waits on its parked request and on
this socket at once. The kernel names the process that sent each datagram: one that
is not from the sender's process (``Welcome.pid``) is dropped, as is anything that is
not a ``Stream``. The hub probes a line when its receiver joins (an empty datagram): a
line it cannot reach (another host or network namespace, not Linux) is not used, and
that receiver's pushes start through the loop as before.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import sys

import msgspec

from ._messages import Stream, encode

__all__ = ["Line", "Starter"]

log = logging.getLogger("rlferry.weights")

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_stream = msgspec.msgpack.Decoder(Stream)


class Line:
    """A receiver's end: bound at a fresh abstract name (``name``), read by its thread."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self.name = ""
        if sys.platform != "linux":
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            name = f"rlferry-line-{os.getpid()}-{secrets.token_hex(8)}"
            s.bind("\0" + name)
            s.setblocking(False)
        except OSError as e:  # no line: pushes start through the loop
            log.info("no start line (%s): streams start through the control channel", e)
            s.close()
            return
        self._sock, self.name = s, name

    @property
    def socket(self) -> socket.socket | None:
        return self._sock

    def take(self, sender_pid: int) -> Stream | None:
        """The last ``Stream`` waiting on the line from process ``sender_pid``, or None
        (probes, strays and malformed datagrams are dropped)."""
        got = None
        while self._sock is not None:
            try:
                data, anc, _, _ = self._sock.recvmsg(256, socket.CMSG_SPACE(_CREDS.size))
            except BlockingIOError:
                return got
            pid = next(
                (_CREDS.unpack(d[: _CREDS.size])[0] for lvl, t, d in anc
                 if lvl == socket.SOL_SOCKET and t == socket.SCM_CREDENTIALS),
                -1,
            )  # fmt: skip
            if not data:
                continue  # the hub's probe
            if pid != sender_pid:
                log.warning("start line: dropped a datagram from pid %d (not the sender's)", pid)
                continue
            try:
                got = _stream.decode(data)
            except msgspec.DecodeError as e:
                log.warning("start line: dropped a malformed datagram: %s", e)
        return got

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Starter:
    """A sender's end: sends starts (and the hub's probes) to receivers' lines."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        if sys.platform == "linux":
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    def probe(self, name: str) -> bool:
        """Whether the line ``name`` can be reached from here."""
        return self.send(name, b"") is None

    def start(self, name: str, msg: Stream) -> str | None:
        """Send ``msg`` to the line ``name``; why it could not go, or None."""
        return self.send(name, encode(msg))

    def send(self, name: str, data: bytes) -> str | None:
        if self._sock is None or not name:
            return "no start line"
        try:
            self._sock.sendto(data, "\0" + name)
        except OSError as e:  # gone (refused), or its queue full: the loop's way instead
            return f"{type(e).__name__}: {e}"
        return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
