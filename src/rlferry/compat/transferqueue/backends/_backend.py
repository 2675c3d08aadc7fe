"""Where the TransferQueue API's state lives: a controller and a store.

``Backend`` is the seam. ``embedded(conf)`` builds both in this process (the
default: no Ray, no cluster, nothing to start). ``remote(...)`` reaches the same
two, held by a service in another process (``_service.py``: a Ray actor of the job,
or the process that called ``tq.init()`` serving its DataLoader workers), through
``RemoteController`` and ``RemoteStore``, which have the same methods. A launcher
registered with ``use_launcher(factory)`` makes ``init(conf)`` call
``factory(conf)`` for its backend instead.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..samplers import BaseSampler
from ..state import Controller, Store
from ._remote import Link, RemoteController, RemoteStore

__all__ = [
    "Backend",
    "Connection",
    "Factory",
    "Part",
    "clear_parts",
    "drop",
    "embedded",
    "put_parts",
    "remote",
]

Part = tuple[
    str, np.ndarray, dict[str, Any], dict[str, dict[str, Any]], list[dict[str, Any]] | None
]
"""One partition's share of a put: ``(partition, global indexes, columns, schema, custom
meta or None)``."""


def put_parts(ctl: Controller, store: Store, parts: list[Part]) -> None:
    """A put: every partition is checked to exist before anything is stored."""
    gone = [pid for pid, *_ in parts if not ctl.has(pid)]
    if gone:
        raise ValueError(
            f"metadata: expected samples of existing partitions, got samples of {gone}, "
            f"which do not exist (cleared since the BatchMeta was made? partitions: "
            f"{ctl.partitions()})"
        )
    for pid, indexes, columns, schema, custom in parts:
        store.put(pid, indexes, columns)
        if custom is not None:  # before the samples are ready: a waiting fetch sees it
            ctl.set_custom(pid, indexes, custom)
        ctl.produced(pid, indexes, schema)


def clear_parts(ctl: Controller, store: Store, parts: list[tuple[str, np.ndarray]]) -> None:
    for pid, indexes in parts:
        store.clear(pid, indexes)
        ctl.clear_samples(pid, indexes)


def drop(ctl: Controller, store: Store, pid: str) -> bool:
    """Drop a partition; False if there is none."""
    if not ctl.drop(pid):
        return False
    store.drop(pid)
    return True


@dataclass(frozen=True)
class Connection:
    """What a process needs to reach a service: its address, the secret (None over a
    loopback or ipc:// address), the fetch timeout, and, on Ray, the actor's name and the
    key its death is watched under."""

    address: str
    secret: str | None
    timeout: float
    actor: str | None = None
    watch: str | None = None
    namespace: str | None = None


@dataclass
class Backend:
    controller: Controller | RemoteController
    store: Store | RemoteStore
    conf: Any = None
    pid: int = field(default_factory=os.getpid)
    """The process that built it: an embedded backend lives in that process's memory."""
    connection: Connection | None = None
    """How other processes reach this backend's state (None: they cannot)."""
    service: Any = None
    """The service that serves this backend to other processes, if this process runs one."""
    on_close: list[Callable[[], None]] = field(default_factory=list)
    """What ``close()`` runs, in order (a link to close, a service or an actor to stop)."""

    # What a client does in one step: on a service, one request each.
    def put(self, parts: list[Part]) -> None:
        if isinstance(self.controller, RemoteController):
            self.controller.put_parts(parts)
        else:
            assert isinstance(self.store, Store)
            put_parts(self.controller, self.store, parts)

    def clear(self, parts: list[tuple[str, np.ndarray]]) -> None:
        if isinstance(self.controller, RemoteController):
            self.controller.clear_parts(parts)
        else:
            assert isinstance(self.store, Store)
            clear_parts(self.controller, self.store, parts)

    def drop(self, pid: str) -> bool:
        if isinstance(self.controller, RemoteController):
            return self.controller.drop_partition(pid)
        assert isinstance(self.store, Store)
        return drop(self.controller, self.store, pid)

    def close(self) -> None:
        while self.on_close:
            self.on_close.pop(0)()


Factory = Callable[[Any], Backend]


def embedded(conf: Any, sampler: BaseSampler, served: bool = False) -> Backend:
    """The controller and the store in this process (``served``: held by a service, whose
    store keeps what it receives and answers from shared memory)."""
    ctl = conf.controller
    return Backend(
        Controller(
            sampler=sampler,
            polling_mode=bool(ctl.polling_mode),
            timeout=float(ctl.get_meta_timeout),
            pre_alloc=int(os.environ.get("TQ_PRE_ALLOC_SAMPLE_NUM", "1")),
        ),
        Store(shared=served),
        conf,
    )


def remote(
    connection: Connection,
    address: str | None = None,
    why_gone: Callable[[str], Awaitable[str]] | None = None,
    conf: Any = None,
) -> Backend:
    """The state a service holds, reached at ``address`` (default: the connection's)."""
    link = Link(address or connection.address, connection.secret, why_gone)
    backend = Backend(
        RemoteController(link, connection.timeout), RemoteStore(link), conf, connection=connection
    )
    backend.on_close.append(link.close)
    return backend
