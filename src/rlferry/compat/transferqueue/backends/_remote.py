"""The client side of the shim's service (``_service.py``): a controller and a store with
the methods of ``Controller`` and ``Store``, each one request over rlferry's wire.

Requests run on the process's wire loop (``rlferry.wire.wire_loop``): a sync call waits
on its future, an ``async_`` one awaits it from the caller's loop without blocking it.
Errors come back as the types the embedded backend raises (``_rpc.ERRORS``); a service
that is gone raises ``ServiceGone`` (a ``RuntimeError``) at once, naming it and, on Ray,
the actor and Ray's reason; one that refuses this process's secret raises the wire's
``SecurityError``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch

from rlferry.errors import RequestError
from rlferry.queue import SchemaError
from rlferry.wire import (
    AsyncClient,
    ChannelClosed,
    PeerGone,
    RemoteError,
    RequestTimeout,
    SecurityError,
    WireError,
    wire_loop,
)

from .._errors import ClientClosed, ServiceGone
from ..metadata import BatchMeta
from ._rpc import ERRORS, columns_in, meta_in, put_columns, schema_out

__all__ = ["Link", "RemoteController", "RemoteStore"]

CALL_TIMEOUT = 60.0
"""Seconds a request that does not wait for data may take before it fails as unanswered."""
_MARGIN = 30.0  # a parked request's reply may come this much after its own timeout


class Link:
    """One connection to a service. ``why_gone(message)`` gives the text of the
    ``ServiceGone`` raised when the service disconnects (a launcher names the cause)."""

    def __init__(
        self,
        address: str,
        secret: str | None = None,
        why_gone: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        self.address = address
        self._secret = secret
        self._why_gone = why_gone
        self._client: AsyncClient | None = None
        self._closed = False

    async def _request(self, op: str, args: list[Any], timeout: float) -> Any:
        if self._client is None:
            if self._closed:
                raise ClientClosed(f"the link to the TransferQueue service {self.address} closed")
            self._client = AsyncClient(self.address, secret=self._secret)
        try:
            return await self._client.request([op, args], timeout)
        except RemoteError as e:
            kind = ERRORS.get(e.kind)
            if kind is None:
                raise RuntimeError(f"{e.kind}: {e.message} (at {self.address})") from None
            raise kind(e.message) from None
        except PeerGone as e:
            message = f"TransferQueue service {self.address}: {e}"
            if self._why_gone is not None:
                message = await self._why_gone(message)
            raise ServiceGone(f"{op}: {message}") from None
        except RequestTimeout:
            raise ServiceGone(
                f"{op}: the TransferQueue service {self.address} did not answer within "
                f"{timeout:g} s (overloaded, or stopped?)"
            ) from None
        except ChannelClosed:
            raise ClientClosed(
                f"{op}: the link to the TransferQueue service {self.address} was closed "
                "(tq.close() ran: call tq.init() again)"
            ) from None
        except SecurityError:
            raise  # the service refused this process's secret: rlferry's own error, as is
        except WireError as e:  # a value the wire does not carry
            raise _Unsendable(f"{op}: {e}") from None

    def call(self, op: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        return wire_loop().run(self._request(op, list(args), timeout))

    async def acall(self, op: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        fut = wire_loop().submit(self._request(op, list(args), timeout))
        return await asyncio.wrap_future(fut)

    def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            wire_loop().run(client.aclose())


class _Unsendable(SchemaError, TypeError):
    """A request held a value the wire does not carry (nothing was sent)."""


_FIELD = re.compile(r"cannot encode `\$\[1\]\[0\]\[\d+\]\[2\]\.([^`\[.]+)[^`]*`: ([^;]+);")


def _ints(indexes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(indexes, dtype=np.int64)


class RemoteController:
    """``Controller``'s methods, answered by the service."""

    def __init__(self, link: Link, timeout: float) -> None:
        self.link = link
        self.timeout = timeout

    def insert(self, pid: str, fields: list[str], n: int) -> BatchMeta:
        return meta_in(self.link.call("insert", pid, fields, n))

    def fetch(
        self, pid: str, fields: list[str], n: int, task: str, config: dict[str, Any]
    ) -> BatchMeta:
        wait = self.timeout + _MARGIN
        return meta_in(self.link.call("fetch", pid, fields, n, task, config, timeout=wait))

    async def async_fetch(
        self, pid: str, fields: list[str], n: int, task: str, config: dict[str, Any]
    ) -> BatchMeta:
        wait = self.timeout + _MARGIN
        return meta_in(await self.link.acall("fetch", pid, fields, n, task, config, timeout=wait))

    def force_fetch(self, pid: str, fields: list[str]) -> BatchMeta:
        return meta_in(self.link.call("force_fetch", pid, fields))

    def has(self, pid: str) -> bool:
        return bool(self.link.call("has", pid))

    def partitions(self) -> list[str]:
        return list(self.link.call("partitions"))

    def produced(self, pid: str, indexes: np.ndarray, schema: dict[str, dict[str, Any]]) -> None:
        self.link.call("produced", pid, _ints(indexes), schema_out(schema))

    def set_custom(self, pid: str, indexes: np.ndarray, custom: list[dict[str, Any]]) -> None:
        self.link.call("set_custom", pid, _ints(indexes), [dict(c) for c in custom])

    def consumption(self, pid: str, task: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, b = self.link.call("consumption", pid, task)
        return a, b

    def production(
        self, pid: str, fields: list[str]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, b = self.link.call("production", pid, fields)
        return a, b

    def reset_consumption(self, pid: str, task: str | None) -> None:
        self.link.call("reset_consumption", pid, task)

    def clear_samples(self, pid: str, indexes: np.ndarray) -> None:
        self.link.call("clear_samples", pid, _ints(indexes))

    def drop(self, pid: str) -> bool:
        return bool(self.link.call("drop", pid))

    # a client's steps that touch both the controller and the store, one request each
    def put_parts(self, parts: list[Any]) -> None:
        wire = [[pid, _ints(i), put_columns(cols), schema_out(schema), custom]
                for pid, i, cols, schema, custom in parts]  # fmt: skip
        try:
            self.link.call("put_parts", wire)
        except _Unsendable as e:
            found = _FIELD.search(str(e))
            if found is None:
                raise
            raise TypeError(
                f"field `{found[1]}`: expected values the wire carries (tensors, numpy arrays, "
                f"str, bytes, numbers, None, lists, dicts with str keys), got a {found[2]} "
                "(convert it: across processes nothing is pickled; nothing was stored)"
            ) from None

    def clear_parts(self, parts: list[tuple[str, np.ndarray]]) -> None:
        self.link.call("clear_parts", [[pid, _ints(i)] for pid, i in parts])

    def drop_partition(self, pid: str) -> bool:
        return bool(self.link.call("drop_partition", pid))

    def kv_meta(self, keys: list[str], pid: str, create: bool) -> BatchMeta:
        return meta_in(self.link.call("kv_meta", keys, pid, create))

    def kv_keys(self, indexes: list[int], pid: str) -> list[str]:
        return list(self.link.call("kv_keys", indexes, pid))

    def kv_list(self, pid: str | None) -> dict[str, dict[str, dict[str, Any]]]:
        out: dict[str, dict[str, dict[str, Any]]] = self.link.call("kv_list", pid)
        return out

    def version(self) -> int:
        return int(self.link.call("version"))

    def wait_change(self, seen: int) -> None:
        self.link.call("wait_change", seen, timeout=self.timeout + _MARGIN)

    def save(self, path: str) -> None:
        self.link.call("save_controller", path)

    def load_from(self, path: str, trust_pickle: bool = False) -> None:
        _local_pickles_only(trust_pickle)
        self.link.call("load_controller", path)


class RemoteStore:
    """``Store``'s methods, answered by the service."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def put(self, partition: str, indexes: np.ndarray, data: dict[str, Any]) -> None:
        self.link.call("store_put", partition, _ints(indexes), put_columns(data))

    def get(self, partition: str, indexes: np.ndarray, fields: list[str]) -> dict[str, Any]:
        return columns_in(self.link.call("store_get", partition, _ints(indexes), fields))

    def clear(self, partition: str, indexes: np.ndarray) -> None:
        self.link.call("store_clear", partition, _ints(indexes))

    def drop(self, partition: str) -> None:
        self.link.call("store_drop", partition)

    def save(self, path: str) -> None:
        self.link.call("save_storage", path)

    def load_from(self, path: str, trust_pickle: bool = False) -> None:
        _local_pickles_only(trust_pickle)
        self.link.call("load_storage", path)


def _local_pickles_only(trust_pickle: bool) -> None:
    """A service reads only the checked format: nothing is unpickled on a network request."""
    if trust_pickle:
        raise RequestError(
            "trust_pickle: a queue service does not unpickle files on a request from the "
            "network; load the pickled checkpoint in an embedded queue (this process) with "
            "trust_pickle=True and save it again in rlferry's format"
        )
