"""The errors of the wire layer: one class per way a message or channel can end."""

from __future__ import annotations

import reprlib
from typing import Any

from rlferry.errors import (
    Closed,
    Gone,
    RemoteError,
    RequestError,
    RlferryError,
    SecurityError,
    Timeout,
)

__all__ = [
    "ChannelClosed",
    "FileFormatError",
    "PeerGone",
    "RemoteError",
    "RequestTimeout",
    "SecurityError",
    "WireError",
    "brief",
]


class WireError(RlferryError):
    """A value that cannot travel, or bytes that are not a valid rlferry message; the
    base of the wire's errors."""


class ChannelClosed(WireError, Closed):
    """You closed this socket (or its owner did); no more requests can be made on it."""


class PeerGone(WireError, Gone):
    """The other side disconnected or died while a request was waiting for its reply."""


class RequestTimeout(WireError, Timeout):
    """No reply came within the request's timeout."""


class FileFormatError(WireError, RequestError):
    """A file that is not a whole rlferry file: another format (``looks_like`` names it
    when it is a pickle or a torch.save archive), a newer format version, truncated, or
    changed since it was written. The message names the file and what is wrong."""

    def __init__(self, message: str, looks_like: str = "") -> None:
        super().__init__(message)
        self.looks_like = looks_like


class _Brief(reprlib.Repr):
    """reprlib that describes a tensor or array by its shape, never by its values."""

    def repr_instance(self, x: Any, level: int) -> str:
        shape = getattr(x, "shape", None)
        if shape is not None and hasattr(x, "dtype"):
            return f"{type(x).__name__}(shape={list(shape)}, dtype={x.dtype})"
        return f"<{type(x).__module__}.{type(x).__qualname__}>"


_brief = _Brief()
_brief.maxstring = _brief.maxother = 40
_brief.maxlevel = 3


def brief(value: Any, limit: int = 60) -> str:
    """A repr of ``value`` for an error message, at most ``limit`` characters, built
    without walking more than a few items of it (values from the network can be huge)."""
    text = _brief.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
