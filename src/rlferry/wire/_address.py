"""Addresses and the security rule: loopback by default, a shared secret off it."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.utils.z85

from rlferry.errors import RequestError

from ._errors import SecurityError

__all__ = [
    "CurveKeys",
    "check_address",
    "curve_keys",
    "default_address",
    "ipc_path",
    "is_local",
    "remove_socket_file",
]

_LOOPBACK_HOSTS = {"localhost", "::1", "[::1]"}
_OURS = re.compile(r"rlferry-(\d+)-[0-9a-f]{12}\.sock")
_swept = False


def default_address(transport: str = "tcp") -> str:
    """A fresh address to bind: 127.0.0.1 on a free port, or a new ipc:// path.

    The first ipc:// address of a process removes the socket files that processes
    which are gone left behind (a crash skips their own removal on close).
    """
    if transport == "tcp":
        return "tcp://127.0.0.1:*"
    if transport == "ipc":
        _sweep_once()
        name = f"rlferry-{os.getpid()}-{uuid.uuid4().hex[:12]}.sock"
        return f"ipc://{os.path.join(tempfile.gettempdir(), name)}"
    raise RequestError(f"transport: expected 'tcp' or 'ipc', got {transport!r}")


def check_address(address: Any) -> str:
    """``address`` if it is a tcp://HOST:PORT, ipc://PATH or inproc://NAME address.

    Raises:
        ValueError: anything else, naming what came and the expected forms.
    """
    scheme, sep, rest = address.partition("://") if isinstance(address, str) else ("", "", "")
    if not sep or not rest or scheme not in ("tcp", "ipc", "inproc"):
        raise RequestError(
            f"address: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {address!r} "
            "(use the address the server printed, scheme included)"
        )
    if scheme == "tcp" and not rest.rpartition(":")[0]:
        raise RequestError(f"address: expected tcp://HOST:PORT, got {address!r} (no port)")
    return address


def is_local(address: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback host."""
    scheme, _, rest = check_address(address).partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0]
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def ipc_path(address: str) -> str | None:
    """The socket file of an ipc:// address (None for other schemes, or abstract names)."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://") :]
    return None if path.startswith("@") else path


def remove_socket_file(address: str) -> None:
    """Remove the socket file of an ipc:// address this process bound (gone already: fine)."""
    path = ipc_path(address)
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _sweep_once() -> None:
    """Remove rlferry socket files in the temp folder whose owner process is gone."""
    global _swept
    if _swept:
        return
    _swept = True
    folder = tempfile.gettempdir()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = _OURS.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):  # another process swept it first, or not ours
            os.unlink(os.path.join(folder, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


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
