"""The HTTP protocol between :class:`~rlferry.control.EngineServer` and
:class:`~rlferry.control.RemoteEngine`: the bodies of the control routes, the frames of
``/generate_many``, and the rule of a bind (a token off loopback). JSON bodies and
msgpack frames encoded by msgspec (never pickle).

:class:`~rlferry.control.RemoteEngine` sends the requests made in one turn of the event
loop as one ``POST /generate_many`` (the demo's coordinator starts a GRPO group's samples
at once); the server answers as a stream of frames, each completion pushed the moment its
request ends, in the order they end: the coordinator awaits each, nothing polls, and one
HTTP exchange carries many samples (one exchange a sample took 12 of a CPU demo step's
130 ms in the driver). ``POST /generate`` answers one request with its completion, for any
HTTP client. A server that dies fails its requests in flight at once (the connection
closes), as :class:`~rlferry.control.EngineGone`; a request the engine refuses fails alone.

A server binds 127.0.0.1 unless told otherwise; any other bind needs a ``token`` (16
bytes or more), which every request must carry (``Authorization: Bearer TOKEN``).
"""

from __future__ import annotations

import struct

import msgspec

from rlferry.wire import SecurityError

from ._engine import Completion, PauseMode

__all__ = [
    "LENGTH",
    "LOOPBACK",
    "Abort",
    "Frame",
    "Pause",
    "Transfer",
    "Version",
    "check_token",
    "split_frames",
]

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class Pause(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /pause``'s body."""

    mode: PauseMode = "keep"


class Abort(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /abort``'s body: the request ids to end (None: all)."""

    ids: list[str] | None = None


class Transfer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /init_weight_transfer``'s body."""

    group: str
    address: str


class Version(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /finish_weight_update``'s body."""

    version: int


class Frame(msgspec.Struct, frozen=True, kw_only=True):
    """One ended request of a ``/generate_many`` stream: ``at`` is its place in the body's
    list; ``completion``, or the error that failed it (``kind`` as in an error answer)."""

    at: int
    done_ns: int
    completion: Completion | None = None
    kind: str = ""
    message: str = ""
    gone: bool = False


LENGTH = struct.Struct(">I")  # a frame's length, before its msgpack bytes
FRAME_DECODER = msgspec.msgpack.Decoder(Frame)


def split_frames(buf: bytearray) -> tuple[list[Frame], int]:
    """The whole frames at the start of ``buf`` (a stream's bytes so far) and how many
    bytes they take; a frame cut short waits for the next bytes. The client reads what
    came at once and splits it here: two reads a frame (its length, then its bytes) cost
    it more CPU than the decoding."""
    out: list[Frame] = []
    at, n = 0, len(buf)
    with memoryview(buf) as view:
        while n - at >= LENGTH.size:
            (size,) = LENGTH.unpack_from(view, at)
            end = at + LENGTH.size + size
            if end > n:
                break
            out.append(FRAME_DECODER.decode(view[at + LENGTH.size : end]))
            at = end
    return out, at


def check_token(host: str, token: str | None) -> None:
    """Refuse a token shorter than 16 bytes, and a bind off loopback without one."""
    if token is not None and len(token.encode()) < 16:
        raise SecurityError(
            f"token: expected at least 16 bytes, got {len(token.encode())} "
            "(use e.g. `openssl rand -hex 32`)"
        )
    if token is None and host not in LOOPBACK:
        raise SecurityError(
            f"bind {host!r}: an engine server off loopback needs a token (pass token=..., the "
            "same on the coordinator's RemoteEngine; or bind 127.0.0.1)"
        )
