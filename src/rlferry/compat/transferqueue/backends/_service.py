"""The shim's state as a service: one process holds the ``Controller`` and the ``Store``
(the same classes as the embedded backend) and answers other processes over rlferry's
wire (``_remote.py`` is the other side).

A request is ``[op, args]``; each op is one method of the controller or the store (a
put's columns, a get's answer and every ``BatchMeta`` in the forms of ``_rpc.py``). A
fetch ``get_meta`` that finds too few samples is parked here, on the service's event
loop, and answered when a put makes them ready or its timeout expires: the client
sends one request and waits for its reply, it never polls. A client that disconnects
takes its parked requests with it at once: nothing is fetched for a reader that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from rlferry.wire import Server

from ..state import Controller, Store
from ._backend import Backend, clear_parts, drop, put_parts
from ._rpc import columns_out, meta_out, schema_in

__all__ = ["Service", "serve"]


_PARKED = ("fetch", "wait_change")  # the requests that wait for data


def _idx(indexes: Any) -> np.ndarray:
    return np.array(indexes, dtype=np.int64).reshape(-1)


class Service:
    """The request handler over a backend's controller and store."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.servers: list[Server] = []
        self._parked: dict[bytes, set[asyncio.Task[Any]]] = {}  # waiting requests by client
        self._counted = threading.Condition()
        c, s = backend.controller, backend.store
        if not isinstance(c, Controller) or not isinstance(s, Store):
            raise TypeError(
                f"backend: expected one that holds the state (a Controller and a Store), got "
                f"{type(c).__name__} and {type(s).__name__} (serve the process that holds it)"
            )
        self._ops: dict[str, Callable[..., Awaitable[Any]]] = {}
        sync: dict[str, Callable[..., Any]] = {
            "insert": lambda pid, fields, n: meta_out(c.insert(pid, fields, n)),
            "force_fetch": lambda pid, fields: meta_out(c.force_fetch(pid, fields)),
            "has": c.has,
            "partitions": c.partitions,
            "produced": lambda pid, i, schema: c.produced(pid, _idx(i), schema_in(schema)),
            "set_custom": lambda pid, i, custom: c.set_custom(pid, _idx(i), custom),
            "consumption": c.consumption,
            "production": c.production,
            "reset_consumption": c.reset_consumption,
            "clear_samples": lambda pid, i: c.clear_samples(pid, _idx(i)),
            "drop": c.drop,
            "kv_meta": lambda keys, pid, create: meta_out(c.kv_meta(keys, pid, create)),
            "kv_keys": c.kv_keys,
            "kv_list": c.kv_list,
            "version": c.version,
            "put_parts": lambda parts: put_parts(
                c,
                s,
                [
                    (pid, _idx(i), cols, schema_in(schema), custom)
                    for pid, i, cols, schema, custom in parts
                ],
            ),
            "clear_parts": lambda parts: clear_parts(c, s, [(pid, _idx(i)) for pid, i in parts]),
            "drop_partition": lambda pid: drop(c, s, pid),
            "store_put": lambda pid, i, columns: s.put(pid, _idx(i), columns),
            "store_get": lambda pid, i, fields: columns_out(s.get(pid, _idx(i), fields)),
            "store_clear": lambda pid, i: s.clear(pid, _idx(i)),
            "store_drop": s.drop,
            # checkpoints are files of the service's host, at the paths the caller names
            "save_controller": c.save,
            # a service never unpickles on a caller's word: over the network, the checked
            # format only (a pickled checkpoint loads embedded, with trust_pickle=True)
            "load_controller": lambda path, trust_pickle=False: c.load_from(path),
            "save_storage": s.save,
            "load_storage": lambda path, trust_pickle=False: s.load_from(path),
        }
        for name, fn in sync.items():
            self._ops[name] = _as_async(fn)
        self._ops["fetch"] = lambda pid, fields, n, task, config: _meta(
            c.async_fetch(pid, fields, n, task, config)
        )
        self._ops["wait_change"] = c.async_wait_change

    async def handle(self, value: Any, peer: bytes) -> Any:
        if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], list):
            raise ValueError(
                f"request: expected [op, args], got {type(value).__name__} (a client of "
                "another version?)"
            )
        op, args = value
        fn = self._ops.get(op) if isinstance(op, str) else None
        if fn is None:
            raise ValueError(f"request: expected an op of {sorted(self._ops)}, got {op!r}")
        if op not in _PARKED:
            return await fn(*args)
        task = asyncio.current_task()
        assert task is not None
        parked = self._parked.setdefault(peer, set())
        with self._counted:
            parked.add(task)
            self._counted.notify_all()
        try:
            return await fn(*args)
        finally:
            with self._counted:
                parked.discard(task)
                if not parked and self._parked.get(peer) is parked:
                    del self._parked[peer]
                self._counted.notify_all()

    def gone(self, peer: bytes) -> None:
        """A client disconnected (closed, died): its parked requests end now, so that a put
        that lands later is not fetched (and marked consumed) for a reader that is gone."""
        for task in list(self._parked.get(peer, ())):
            task.cancel()

    def parked(self) -> int:
        """How many requests wait for data now."""
        with self._counted:
            return sum(map(len, self._parked.values()))

    def wait_parked(self, n: int, timeout: float) -> bool:
        """Wait (from another thread) until ``n`` requests wait for data; False on timeout."""
        with self._counted:
            return self._counted.wait_for(
                lambda: sum(map(len, self._parked.values())) == n, timeout
            )

    async def close(self) -> None:
        for server in self.servers:
            await server.aclose()
        self.servers.clear()


def _as_async(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    async def call(*args: Any) -> Any:
        return fn(*args)

    return call


async def _meta(pending: Awaitable[Any]) -> Any:
    return meta_out(await pending)


async def serve(
    backend: Backend, binds: list[str], secret: str | None = None
) -> tuple[Service, list[str]]:
    """Serve ``backend`` on the running loop at each of ``binds``; returns the service and
    the bound addresses, in the same order. A non-loopback bind needs ``secret``."""
    service = Service(backend)
    try:
        for bind in binds:
            server = Server(service.handle, bind, secret=secret, on_disconnect=service.gone)
            service.servers.append(server)
            await server.start()
    except BaseException:
        with contextlib.suppress(Exception):
            await service.close()
        raise
    return service, [s.address for s in service.servers]
