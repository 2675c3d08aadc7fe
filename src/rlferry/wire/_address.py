"""Addresses and the security rule: loopback by default, a shared secret off it."""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from dataclasses import dataclass

import zmq
import zmq.utils.z85

from ._errors import SecurityError

__all__ = ["CurveKeys", "curve_keys", "default_address", "is_local"]

_LOOPBACK_HOSTS = {"localhost", "::1", "[::1]"}


def default_address(transport: str = "tcp") -> str:
    """A fresh address to bind: 127.0.0.1 on a free port, or a new ipc:// path."""
    if transport == "tcp":
        return "tcp://127.0.0.1:*"
    if transport == "ipc":
        name = f"rlferry-{os.getpid()}-{uuid.uuid4().hex[:12]}.sock"
        return f"ipc://{os.path.join(tempfile.gettempdir(), name)}"
    raise ValueError(f"transport: expected 'tcp' or 'ipc', got {transport!r}")


def is_local(address: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback host."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        raise ValueError(
            f"address: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {address!r}"
        )
    host = rest.rpartition(":")[0]
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def check_bind(address: str, secret: str | bytes | None) -> None:
    """Refuse a bind off loopback without a shared secret.

    Raises:
        SecurityError: ``address`` is reachable from other hosts and no secret was given.
    """
    if secret is None and not is_local(address):
        raise SecurityError(
            f"bind {address!r}: a non-loopback bind needs a shared secret "
            "(pass secret=..., the same on every client; or bind tcp://127.0.0.1)"
        )


@dataclass(frozen=True)
class CurveKeys:
    """CURVE key pairs (z85) derived from a shared secret, for both ends."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _pair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    raw = hashlib.sha256(b"rlferry/curve/" + role + b"/" + secret).digest()
    sk = zmq.utils.z85.encode(raw)
    return zmq.curve_public(sk), sk


def curve_keys(secret: str | bytes) -> CurveKeys:
    """Both ends derive the same keys from the secret: only holders of it can talk.

    The client proves it holds the secret by its key pair, checked by the
    server's ZAP handler; the traffic is encrypted by CURVE.
    """
    if isinstance(secret, str):
        secret = secret.encode()
    if len(secret) < 16:
        raise SecurityError(
            f"secret: expected at least 16 bytes, got {len(secret)} "
            "(use e.g. `openssl rand -hex 32`)"
        )
    spub, ssec = _pair(secret, b"server")
    cpub, csec = _pair(secret, b"client")
    return CurveKeys(spub, ssec, cpub, csec)
