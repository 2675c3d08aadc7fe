"""A receiver's connection to its sender: its own socket to the sender's control service,
the key and the sender's process it learns when it joins, its start line (read) and the
sender's commit line (told of each commit): see ``protocol._datagrams``."""

from __future__ import annotations

import logging
import os
import socket

import msgspec

from rlferry.wire import Client, PeerGone, RemoteError, RequestTimeout, SecurityError, WireError

from .._config import ReceiverConfig
from .._errors import SenderGone, WeightSyncError
from ..protocol._datagrams import Line, Starter
from ..protocol._messages import Ack, Bucket, Join, Leave, Stream, Welcome, decode_reply, encode

__all__ = ["Connection"]

log = logging.getLogger("rlferry.weights")
_HEARD = 10.0  # seconds a sender has to answer a receiver whose stream broke (see heard)


class Connection:
    """Receiver ``name``'s connection to the sender at ``config.address``. ``client``: the
    serving thread's own socket to the sender (its messages go without a hop to the wire
    loop's thread and back: they are most of a small push's time); ``key``: this
    receiver's key at the sender (``Welcome``'s)."""

    def __init__(self, config: ReceiverConfig, name: str) -> None:
        self.config, self.name = config, name
        self.client: Client | None = None
        self.key = b""
        # where the sender's pushing thread may start its streams, and the sender's
        # process, the only one whose starts it takes
        self._line: Line | None = None
        self._sender_pid = 0
        # a mailbox sender's commit line, told of each commit before its acknowledgement
        self._commits = ""
        self._teller: Starter | None = None

    def open(self, timeout: float) -> Welcome:
        """Connect and join (see :meth:`join`)."""
        self.client = Client(self.config.address, secret=self.config.secret)
        self._line = Line()
        try:
            return self.join(timeout)
        except BaseException:
            self._line.close()
            raise

    def join(self, timeout: float | None) -> Welcome:
        """Join the sender's group (again, after the sender forgot this receiver): its
        ``Welcome``; raises (the socket closed) if the sender refuses or cannot be reached."""
        assert self.client is not None
        c = self.config
        line = self._line.name if self._line is not None else ""
        join = Join(
            c.group, "", self.name, socket.gethostname(), os.getpid(), c.verify, line,
            c.deltas or "",
        )  # fmt: skip
        try:
            reply = decode_reply(self.client.request(encode(join), timeout))
        except RemoteError as e:
            self.client.close()
            raise WeightSyncError(
                f"receiver `{self.name}` cannot join group {c.group!r} at {c.address}: {e.message}"
            ) from None
        except PeerGone as e:
            self.client.close()
            raise SenderGone(
                f"receiver `{self.name}` cannot reach the sender at {c.address}: {e}"
            ) from None
        except RequestTimeout:
            self.client.close()
            raise SenderGone(
                f"receiver `{self.name}`: no answer from the sender at {c.address} within "
                f"{timeout:g} s (is the sender running, and is this its address?)"
            ) from None
        except (WireError, SecurityError) as e:
            self.client.close()
            raise WeightSyncError(
                f"receiver `{self.name}`: no answer from the sender at {c.address}: {e}"
            ) from None
        assert isinstance(reply, Welcome)
        self.key, self._sender_pid = reply.key, reply.pid
        self._commits = reply.commits
        if self._commits and self._teller is None:
            self._teller = Starter()
        if not reply.line and self._line is not None:  # the sender could not reach it
            self._line.close()
            self._line = None
        return reply

    def wait(self, rid: bytes) -> bytes | None:
        """The reply to request ``rid``, or None when the start line has something first."""
        assert self.client is not None
        return self.client.wait(rid, also=self._line.socket if self._line is not None else None)

    def take_start(self) -> Stream | Bucket | None:
        """The start waiting on the start line (see ``Line.take``)."""
        assert self._line is not None
        return self._line.take(self._sender_pid)

    def say_committed(self, seq: int) -> None:
        """Tell the sender's commit line that push ``seq`` was committed here (first: the
        pushing thread waits there)."""
        if self._teller is not None:
            self._teller.committed(self._commits, seq, self.key)

    def note(self, ack: Ack) -> None:
        """A bare acknowledgement: sent, its (empty) answer not waited for. If it cannot go
        (the sender went away, the receiver closed), the wait that follows says so."""
        assert self.client is not None
        try:
            self.client.send(encode(msgspec.structs.replace(ack, park=False)), reply=False)
        except (WireError, RemoteError, SecurityError) as e:
            log.debug("receiver %s: an acknowledgement was not sent: %s", self.name, e)

    def heard(self, ack: Ack) -> None:
        """Tell the sender of a stream that broke (``ack``), unparked; raises ``PeerGone``
        if it went away (see ``WeightReceiver._heard``)."""
        assert self.client is not None
        try:
            self.client.request(encode(msgspec.structs.replace(ack, park=False)), _HEARD)
        except (RequestTimeout, RemoteError) as e:  # there, but it did not hear: the next ask says
            log.warning("receiver %s: the sender did not take the failure: %s", self.name, e)

    def leave(self) -> None:
        """Leave first: the sender drops this receiver now, not when it sees the socket go
        (and if the sender is gone already, there is nobody to tell). A wait of the
        serving thread ends at once."""
        if self.client is not None:
            self.client.close(farewell=encode(Leave()))

    def close_lines(self) -> None:
        """Let the start line and the commit line's socket go (the serving thread is done)."""
        if self._line is not None:
            self._line.close()
        if self._teller is not None:
            self._teller.close()
