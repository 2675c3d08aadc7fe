"""The start line and the commit line: datagram sockets that skip the wire loop.

**The start line.** A push over a collective transport whose receivers hold its plan
and group needs one message before its stream: ``Stream``. Through the control channel
it goes from the pushing thread to the wire loop (the begin), from the loop to each
receiver's parked request, and through ZeroMQ's I/O threads of both processes: with 2
trainer ranks to a TP=2 engine at 4.1 GB, the receivers' first receives are posted
0.9-1.0 ms after the push is called that way, most of it those hops (``python
benchmarks/weights_sharded.py --device cuda --transport broadcast --point-to-point
--senders 2 --receivers 2 --scale 2 --trace DIR`` on four H200s).

So a receiver also listens on a datagram socket in Linux's abstract namespace
(nothing on disk, this host's network namespace only), named in its ``Join``; the
sender's pushing thread sends ``Stream`` there (one ``sendto`` a receiver, no loop)
and tells its hub after. The receiver's thread waits on its parked request and on
this socket at once. The kernel names the process that sent each datagram: one that
is not from the sender's process (``Welcome.pid``) is dropped, as is anything that is
not a start (``Stream``, ``Bucket``). The hub probes a line when its receiver joins (an
empty datagram): a line it cannot reach (another host or network namespace, not Linux)
is not used, and that receiver's pushes start through the loop.

A mailbox push (shm, cuda_ipc) that the pushing thread starts alone (its receivers
committed the last push and read the tensors in place: ``Launcher.lean``) announces
its every bucket on the lines the same way: one ``Bucket`` naming them all, sent once
the tensors are ready; the hub then answers no parked request of a receiver told there.

**The commit line**, the other way: a mailbox sender (shm, cuda_ipc) listens on one
too, named in its ``Welcome``; a receiver that committed a push says so there first
(``Committed``), then acknowledges through the control channel. The pushing thread
waits on this socket, not on the wire loop: a commit's acknowledgement reaches the
sender's loop 0.1-0.6 ms after it goes, and the pushing thread 0.2 ms after that (2
trainer ranks to a TP=2 engine, ``--transport cuda_ipc --gpus 4`` above). The hub says
there too when the push settled (a failure, a receiver gone: an empty datagram from
the sender's own process).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import sys
import time
from typing import Any

import msgspec

from ._messages import Bucket, Committed, Stream, encode

__all__ = ["Commits", "Line", "Starter"]

log = logging.getLogger("rlferry.weights")

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_start = msgspec.msgpack.Decoder(Stream | Bucket)
_committed = msgspec.msgpack.Decoder(Committed)


class _Bound:
    """A datagram socket at a fresh abstract name (``name``) that learns each sender's pid;
    none (``name`` empty) off Linux or where it cannot be bound."""

    def __init__(self, prefix: str, what: str) -> None:
        self._sock: socket.socket | None = None
        self.name = ""
        if sys.platform != "linux":
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            name = f"rlferry-{prefix}-{os.getpid()}-{secrets.token_hex(8)}"
            s.bind("\0" + name)
        except OSError as e:  # no line: the control channel alone
            log.info("no %s line (%s): the control channel alone", what, e)
            s.close()
            return
        self._sock, self.name = s, name

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _receive(s: socket.socket) -> tuple[bytes, int]:
    """One datagram and the pid of the process that sent it (-1: not said)."""
    data, anc, _, _ = s.recvmsg(256, socket.CMSG_SPACE(_CREDS.size))
    pid = next(
        (_CREDS.unpack(d[: _CREDS.size])[0] for lvl, t, d in anc
         if lvl == socket.SOL_SOCKET and t == socket.SCM_CREDENTIALS),
        -1,
    )  # fmt: skip
    return data, pid


class Line(_Bound):
    """A receiver's end: bound at a fresh abstract name (``name``), read by its thread."""

    def __init__(self) -> None:
        super().__init__("line", "start")
        if self._sock is not None:
            self._sock.setblocking(False)

    @property
    def socket(self) -> socket.socket | None:
        return self._sock

    def take(self, sender_pid: int) -> Stream | Bucket | None:
        """The last start (``Stream`` or ``Bucket``) waiting on the line from process
        ``sender_pid``, or None (probes, strays and malformed datagrams are dropped)."""
        got: Stream | Bucket | None = None
        while self._sock is not None:
            try:
                data, pid = _receive(self._sock)
            except BlockingIOError:
                return got
            if not data:
                continue  # the hub's probe
            if pid != sender_pid:
                log.warning("start line: dropped a datagram from pid %d (not the sender's)", pid)
                continue
            try:
                got = _start.decode(data)
            except msgspec.DecodeError as e:
                log.warning("start line: dropped a malformed datagram: %s", e)
        return got


class Commits(_Bound):
    """A mailbox sender's commit line (see the module's note): bound at ``name``, read by
    the pushing thread."""

    def __init__(self) -> None:
        super().__init__("commits", "commit")
        self._wakes = Starter()

    def wake(self) -> None:
        """Say that the push settled at the hub (from the wire loop): its wait looks again."""
        self._wakes.send(self.name, b"")

    def wait(self, seq: int, members: dict[bytes, int], settled: Any, deadline: float) -> bool:
        """Whether every one of ``members`` (key: its pid) said here that it committed push
        ``seq``: True once all did; False once the push ``settled`` (a ``threading.Event``)
        at the hub with a word missing, at ``deadline``, or without a line (the hub then
        says the rest). What is on the line is read before the hub is asked: a receiver
        says it here before its acknowledgement goes."""
        s, got = self._sock, set()
        if s is None:
            return False
        draining = True  # what came meanwhile (stale wakes too) is read without waiting
        last = False  # the push settled: what is on the line now is read once more
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            s.settimeout(0.0 if draining else left)
            try:
                data, pid = _receive(s)
            except BlockingIOError:  # all read
                if last:
                    return False
                # settled after the read came back empty: its members' words, sent before
                # their acknowledgements, came meanwhile (one run in 25 under load)
                last = settled.is_set()
                draining = last
                continue
            except TimeoutError:
                return False
            draining = True
            if not data:
                continue  # the hub: the push settled (looked at once the line is read)
            try:
                c = _committed.decode(data)
            except msgspec.DecodeError as e:
                log.warning("commit line: dropped a malformed datagram: %s", e)
                continue
            if c.seq == seq and members.get(c.key) == pid:
                got.add(c.key)
                if len(got) == len(members):
                    return True

    def close(self) -> None:
        self._wakes.close()
        super().close()


class Starter:
    """Sends datagrams to lines: a sender's starts (and the hub's probes) to its receivers'
    lines, a receiver's commits to its sender's commit line."""

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

    def committed(self, name: str, seq: int, key: bytes) -> None:
        """Tell the commit line ``name`` that push ``seq`` was committed here (a datagram
        that cannot go is dropped: the acknowledgement that follows says it)."""
        why = self.send(name, encode(Committed(seq, key)))
        if why is not None:
            log.debug("commit line %s: not told of push %d: %s", name, seq, why)

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
