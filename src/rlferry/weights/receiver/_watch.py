"""A receiver's watch over the NCCL streams it takes part in.

A receiver's serving thread waits on the device at the end of a stream, deaf to its
socket. Were the stream never to end (another receiver of the group died, the
sender failed or died mid-stream), it would wait until NCCL's timeout, and the
next push would find it busy. So, once it streams over NCCL, a second connection
of its process, on the wire loop, keeps a ``Watch`` parked at the sender: the sender
answers it when it aborts a push this receiver takes part in, and the connection
fails at once when the sender dies. Either way this receiver's side of the group is
aborted (off the loop: an abort takes a while), the wait on the device ends, and the
stream returns the reason. Nothing polls: the watch is one parked request.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable

from rlferry.wire import (
    AsyncClient,
    ChannelClosed,
    RemoteError,
    SecurityError,
    WireError,
    wire_loop,
)

from ..protocol._messages import Abort, Watch, decode_reply, encode

__all__ = ["StreamWatch"]

log = logging.getLogger("rlferry.weights")


class StreamWatch:
    """One receiver's watch; :meth:`arm` starts it, :meth:`streaming` and
    :meth:`streamed` bracket each stream, :meth:`close` ends it."""

    def __init__(self, address: str, secret: str | bytes | None, name: str) -> None:
        self._address, self._secret, self._name = address, secret, name
        self._lock = threading.Lock()
        self._key = b""
        self._task: concurrent.futures.Future[None] | None = None
        self._client: AsyncClient | None = None
        self._aborted: tuple[int, str] = (0, "")  # the last push the sender aborted
        self._gone = ""  # why the sender can be reached no more
        self._streaming: tuple[int, Callable[[], None]] | None = None
        self._hit = ""  # why the stream in progress was aborted
        self._closed = False

    def arm(self, key: bytes) -> None:
        """Watch as the member ``key`` (the one ``Welcome`` gave); again after a new join."""
        with self._lock:
            self._key = key
            if self._closed or (self._task is not None and not self._task.done()):
                return
            self._task = wire_loop().submit(self._run())
            self._task.add_done_callback(self._ended)

    def _ended(self, task: concurrent.futures.Future[None]) -> None:
        if not task.cancelled() and task.exception() is not None:  # a bug: never hidden
            log.error("receiver %s: its watch failed", self._name, exc_info=task.exception())

    def streaming(self, seq: int, abort: Callable[[], None]) -> str | None:
        """The stream of push ``seq`` begins; ``abort`` ends it from another thread. Why it
        must not begin (the sender aborted that push already, or went away), or None."""
        with self._lock:
            if self._gone:
                return self._gone
            if self._aborted[0] == seq:
                return self._aborted[1]
            self._streaming, self._hit = (seq, abort), ""
        return None

    def streamed(self) -> str | None:
        """The stream ended: why it was aborted, or None."""
        with self._lock:
            self._streaming = None
            return self._hit or None

    async def _run(self) -> None:
        with self._lock:
            if self._closed:
                return
            client = self._client = AsyncClient(self._address, secret=self._secret)
        seen = 0
        try:
            while True:
                key = self._key
                try:
                    reply = decode_reply(await client.request(encode(Watch(key, seen))))
                except ChannelClosed:
                    return
                except (WireError, RemoteError, SecurityError) as e:  # it died, or refuses us
                    self._end(None, f"the sender went away mid-stream: {e}")
                    return
                if isinstance(reply, Abort):
                    seen = reply.seq
                    self._end(reply.seq, f"the sender aborted the push: {reply.reason}")
                elif key == self._key:  # it left: a new join arms the watch again
                    return
        finally:
            await client.aclose()

    def _end(self, seq: int | None, why: str) -> None:
        with self._lock:
            if seq is None:
                self._gone = why
            else:
                self._aborted = (seq, why)
            s = self._streaming
            if s is None or (seq is not None and s[0] != seq) or self._hit:
                return
            self._hit = why
        log.info("receiver %s: %s; its stream is aborted", self._name, why)
        wire_loop().loop.run_in_executor(None, s[1])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client = self._client
        if client is not None:  # its parked Watch ends (ChannelClosed), and the task
            wire_loop().submit(client.aclose())
