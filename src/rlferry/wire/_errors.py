"""The errors of the wire layer: one class per way a message or channel can end."""

from __future__ import annotations

__all__ = [
    "ChannelClosed",
    "PeerGone",
    "RemoteError",
    "RequestTimeout",
    "SecurityError",
    "WireError",
]


class WireError(Exception):
    """A value that cannot travel, or bytes that are not a valid rlferry message."""


class ChannelClosed(WireError):
    """You closed this socket (or its owner did); no more requests can be made on it."""


class PeerGone(WireError):
    """The other side disconnected or died while a request was waiting for its reply."""


class RequestTimeout(WireError, TimeoutError):
    """No reply came within the request's timeout."""


class RemoteError(WireError):
    """The server's handler raised; ``kind`` is the remote exception's class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class SecurityError(WireError):
    """A bind or connect that would expose a service without a shared secret."""
