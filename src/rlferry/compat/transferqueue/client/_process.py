"""The module API's state in this process: the backend ``tq.init()`` made or reached, the
client it made, and how a worker process reaches the queue's state.

A forked child (a DataLoader worker) keeps how its parent reached the state, not the parent's
objects; a spawned one is handed a ``Connection`` (``attach``); a task or actor of a Ray job
whose driver runs the queue on Ray finds the job's service actor by name.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from rlferry.wire import default_address, wire_loop

from .._errors import NotInitialized
from ..backends import Backend, Connection, Factory, remote, serve

if TYPE_CHECKING:
    from ._client import TransferQueueClient

__all__ = [
    "HERE",
    "NOT_INIT",
    "Here",
    "attach",
    "current_backend",
    "drop",
    "ended",
    "serve_workers",
    "use_launcher",
]

NOT_INIT = (
    "TransferQueue is not initialized: expected tq.init() first, got a call before it or "
    "after tq.close() (Please call init() first)"
)


class Here:
    """This process's backend and the module API's client."""

    def __init__(self) -> None:
        self.backend: Backend | None = None
        self.client: TransferQueueClient | None = None
        self.launcher: Factory | None = None
        """The factory ``use_launcher`` registered, or None for the built-in choice."""
        self.inherited: tuple[Connection, str] | None = None
        """In a forked child: how the parent reached its service (connection, address dialed)."""
        self.parent: int | None = None
        """In a forked child of an embedded queue that serves nobody: the parent's pid."""


HERE = Here()


def use_launcher(factory: Factory | None) -> None:
    """Make ``init()`` build its controller and store with ``factory(conf)`` (a launcher that
    runs them as services elsewhere); ``None`` goes back to the built-in choice."""
    HERE.launcher = factory


def _after_fork() -> None:
    """A forked child (a DataLoader worker) keeps how its parent reached the queue's state,
    not the parent's objects: an embedded backend there would be a stale copy, and sockets
    do not survive a fork. Its first call connects again (``current_backend``)."""
    backend = HERE.backend
    if backend is not None and backend.connection is not None:
        link = getattr(backend.controller, "link", None)
        HERE.inherited = (backend.connection, link.address if link else backend.connection.address)
    elif backend is not None:
        HERE.parent = backend.pid
    HERE.backend = HERE.client = None


os.register_at_fork(after_in_child=_after_fork)


def current_backend(_controller_info: Any = None) -> Backend:
    """The backend of this process: the one ``init()`` made; in a forked child of that
    process (a DataLoader worker) or in a Ray worker of a job whose driver runs the queue on
    Ray, one connected to the queue's service (made on first use)."""
    if HERE.backend is not None and HERE.backend.pid == os.getpid():
        if not ended(HERE.backend):
            return HERE.backend
        drop()  # its actor died: a reused Ray worker connects to the job's new one
    if HERE.inherited is not None:
        connection, address = HERE.inherited
        HERE.backend = remote(connection, address)
        return HERE.backend
    if HERE.parent is not None:
        raise RuntimeError(
            f"process {os.getpid()}: expected the process that called tq.init() "
            f"({HERE.parent}) or a child that can reach its queue, got a forked child of an "
            "embedded queue that serves no other process (a StreamingDataLoader with "
            "num_workers > 0 serves its workers; for other processes run the queue on Ray: "
            "ray.init() before tq.init())"
        )
    if _in_ray_worker():
        from ..backends import _ray

        found = _ray.attach()
        if found is not None:
            HERE.backend = found
            return HERE.backend
    raise NotInitialized(NOT_INIT)


def ended(backend: Backend) -> bool:
    """A backend on a Ray actor that Ray reported dead."""
    watch = backend.connection.watch if backend.connection is not None else None
    if watch is None:
        return False
    from rlferry.ray._common import deaths

    return deaths.ended(watch)


def drop() -> None:
    """Forget this process's backend and client, closing the backend."""
    backend, HERE.backend, HERE.client = HERE.backend, None, None
    if backend is not None:
        backend.close()


def _in_ray_worker() -> bool:
    """True in a task or actor of a Ray job (not its driver)."""
    ray = sys.modules.get("ray")
    return bool(
        ray is not None
        and ray.is_initialized()
        and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    )


def serve_workers() -> Connection:
    """How this process's children reach the queue's state: for an embedded backend, serve
    it from this process over ipc:// (on the wire loop, until ``tq.close()``)."""
    backend = current_backend()
    if backend.connection is None:
        loop = wire_loop()
        service, (address,) = loop.run(serve(backend, [default_address("ipc")]))
        timeout = float(backend.controller.timeout)
        backend.connection, backend.service = Connection(address, None, timeout), service
        backend.on_close.insert(0, lambda: wire_loop().run(service.close()))
    return backend.connection


def attach(connection: Connection) -> None:
    """Reach the queue's state through ``connection`` in a process that did not inherit it
    (a spawned DataLoader worker)."""
    if HERE.inherited is None and (HERE.backend is None or HERE.backend.pid != os.getpid()):
        HERE.backend, HERE.client = remote(connection), None
