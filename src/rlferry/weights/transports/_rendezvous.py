"""Where a broadcast group meets: a rendezvous store that only the group's peers reach.

The kind follows the sender's control channel, which the wire already guards
(loopback unless a secret is given):

- **No secret** (the control channel is on loopback or ipc://): a TCPStore on a
  socket that rlferry binds to the control bind's loopback host (127.0.0.1 by
  default) and hands to torch (``master_listen_fd``): nothing listens on other
  interfaces.
- **A secret** (the control channel is CURVE-authenticated, as any off-host bind
  must be): no store socket at all. The pairs live in the sender's process, on
  its wire loop (:class:`KeyValue`); the sender's rank reaches them directly and
  every receiver through store requests on its authenticated control connection.
  Both ends use one :class:`CallStore`, a ``torch.distributed.Store`` written in
  Python that turns each operation into a :class:`~.._messages.StoreOp`.

Values are bytes, kept and returned as they are: nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .._errors import WeightSyncError
from ..protocol._messages import StoreOp, StoreReply

__all__ = ["CallStore", "KeyValue", "gloo_device", "local_host_towards", "loopback_store"]

_LOOPBACK = ("127.0.0.1", "::1")


def loopback_store(host: str) -> Any:
    """A TCPStore (the master) listening only on ``host``, a loopback address.

    We bind the socket ourselves and hand torch a duplicate of it: torch owns
    and closes the duplicate; ours closes here.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        sock.listen(1024)
        port = int(sock.getsockname()[1])
        fd = os.dup(sock.fileno())
        try:
            return dist.TCPStore(
                host, port, None, True, wait_for_workers=False, master_listen_fd=fd,
                use_libuv=True,
            )  # fmt: skip
        except RuntimeError as e:
            if os.fstat(fd).st_ino == os.fstat(sock.fileno()).st_ino:  # torch did not take it
                os.close(fd)
            raise WeightSyncError(
                f"cannot start the broadcast rendezvous store on {host}:{port}: {e}"
            ) from None


def gloo_device(host: str | None) -> Any:
    """A gloo device whose sockets listen on ``host`` (None: torch's default interface)."""
    if host is None:
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=host)


def local_host_towards(host: str) -> str | None:
    """The local address this host uses to reach ``host`` (no packet is sent): the
    interface a receiver's gloo sockets should listen on. None if no route is known."""
    if host in _LOOPBACK or host.startswith("127.") or host == "localhost":
        return "::1" if host == "::1" else "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return None


class KeyValue:
    """The store's pairs, in the sender's process; every method runs on the wire loop.

    ``get`` and ``wait`` park on futures that ``set``, ``add`` and ``compare_set``
    complete: nothing polls.
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}

    def _put(self, key: str, value: bytes) -> None:
        self._data[key] = value
        for fut in self._waiters.pop(key, []):
            if not fut.done():
                fut.set_result(None)

    async def _until(self, keys: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for key in keys:
            while key not in self._data:
                fut = asyncio.get_running_loop().create_future()
                self._waiters.setdefault(key, []).append(fut)
                try:
                    await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise WeightSyncError(
                        f"rendezvous key {key!r}: not set within {timeout:g} s (a peer of "
                        "the group did not arrive)"
                    ) from None

    async def serve(self, op: StoreOp) -> StoreReply:
        """Do ``op``; raises WeightSyncError for an unknown operation or a wait that timed out."""
        if op.op == "set":
            self._put(op.key, op.value)
            return StoreReply()
        if op.op == "get":
            await self._until([op.key], op.timeout)
            return StoreReply(value=self._data[op.key])
        if op.op == "wait":
            await self._until(op.keys, op.timeout)
            return StoreReply()
        if op.op == "check":
            return StoreReply(number=int(all(k in self._data for k in op.keys)))
        if op.op == "add":
            n = int(self._data.get(op.key, b"0")) + op.amount
            self._put(op.key, str(n).encode())
            return StoreReply(number=n)
        if op.op == "compare_set":
            cur = self._data.get(op.key)
            if (cur is None and op.expected == b"") or cur == op.expected:
                self._put(op.key, op.value)
                return StoreReply(value=op.value)
            return StoreReply(value=op.expected if cur is None else cur)
        if op.op == "delete":
            return StoreReply(number=int(self._data.pop(op.key, None) is not None))
        if op.op == "num_keys":
            return StoreReply(number=len(self._data))
        raise WeightSyncError(
            f"store request: expected an operation of set, get, wait, check, add, compare_set, "
            f"delete, num_keys; got {op.op!r}"
        )

    def drop(self, prefix: str) -> None:
        """Forget every key of a group that is gone."""
        for key in [k for k in self._data if k.startswith(prefix)]:
            del self._data[key]


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class CallStore(dist.Store):
    """A ``torch.distributed.Store`` whose every operation is ``call(StoreOp)``.

    The sender's call runs the operation on its :class:`KeyValue`; a receiver's
    sends it to the sender over the control connection. ``timeout``: how long a
    ``get`` or ``wait`` waits for its keys. A failed call raises
    ``torch.distributed.DistStoreError``, as torch's own stores do.
    """

    def __init__(self, call: Callable[[StoreOp], StoreReply], timeout: float) -> None:
        super().__init__()
        self._call = call
        self._timeout = timeout

    def _do(self, op: StoreOp) -> StoreReply:
        try:
            return self._call(op)
        except (WeightSyncError, OSError, RuntimeError) as e:
            raise dist.DistStoreError(f"rendezvous {op.op} {op.key or op.keys!r}: {e}") from None

    def set(self, key: str, value: Any) -> None:
        self._do(StoreOp("set", key, value=_bytes(value)))

    def get(self, key: str) -> bytes:
        return self._do(StoreOp("get", key, timeout=self._timeout)).value

    def add(self, key: str, value: int) -> int:
        return self._do(StoreOp("add", key, amount=int(value))).number

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        op = StoreOp("compare_set", key, value=_bytes(desired_value),
                     expected=_bytes(expected_value))  # fmt: skip
        return self._do(op).value

    def check(self, keys: list[str]) -> bool:
        return bool(self._do(StoreOp("check", keys=list(keys))).number)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        t = self._timeout if timeout is None else timeout.total_seconds()
        self._do(StoreOp("wait", keys=list(keys), timeout=t))

    def delete_key(self, key: str) -> bool:
        return bool(self._do(StoreOp("delete", key)).number)

    def num_keys(self) -> int:
        return self._do(StoreOp("num_keys")).number

    # torch's C++ side calls these by their C++ names
    deleteKey = delete_key
    getNumKeys = num_keys

    def clone(self) -> CallStore:
        return self
