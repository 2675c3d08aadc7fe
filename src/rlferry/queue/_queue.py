"""``Queue``: start one embedded (nothing to launch by hand), or connect to one served elsewhere.

Embedded, the controller and the storage units are wire services on the
process's background loop, bound on ipc:// so that clients in this or other
processes of the host move payload through shared memory. (Measured choice:
threads start in milliseconds; child processes cost seconds each to import
torch and buy nothing for throughput, since the bytes move through shared
memory either way. ``rlferry serve queue`` runs them as separate processes.)
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from rlferry.wire import Server, default_address, wire_loop
from rlferry.wire.files import new_directory, read_file, whole_directory, write_file

from ._checks import checked_address
from ._client import AsyncQueueClient
from ._config import QueueConfig
from ._errors import QueueClosed, SchemaError
from ._links import Links
from ._messages import Dump, Info, Load
from ._sync_client import QueueClient
from .services import Controller, StorageUnit
from .statistics import QueueStatistics

__all__ = ["Queue"]

_DUMP_TIMEOUT = 60.0  # the controller's state: metadata only
_DATA_TIMEOUT = 600.0  # a storage unit's payload


class Queue:
    """A rollout queue: partitions of samples, fields as columns, tasks that each read all once.

    ``Queue(...)`` starts an embedded queue in this process; :meth:`connect` is a
    handle on one served by ``rlferry serve queue``; :meth:`restore` resumes from
    :meth:`save`. ``close()`` (idempotent; also on ``with``'s exit) closes the
    clients made here and stops the services this queue started.
    """

    address: str

    def __init__(
        self,
        *,
        storage_units: int = 2,
        tasks: tuple[str, ...] | list[str] = ("train",),
        capacity: int | None = None,
        max_partitions: int | None = None,
        lease_timeout: float = 60.0,
        bind: str | None = None,
        secret: str | bytes | None = None,
    ) -> None:
        """Start a controller and ``storage_units`` storage units in this process.

        The options are :class:`~rlferry.queue.services.QueueConfig`'s (checked
        before anything starts): ``tasks``, the consumers that each read every sample
        once (e.g. ``("actor_train", "critic_train")``); ``capacity``, samples held at
        most; ``max_partitions``, unfinished partitions at most (the staleness bound);
        a put over either waits for room. ``lease_timeout``: seconds a got batch stays
        leased without an ack before it is delivered again. ``bind``: the controller's
        address (default a fresh ipc:// path); off loopback it needs ``secret``.

        Raises:
            SchemaError: an option does not fit (naming it).
            SecurityError: ``bind`` is off loopback without a ``secret``, or the secret
                is too short.
        """
        config = QueueConfig(
            storage_units=storage_units,
            tasks=tuple(tasks) if isinstance(tasks, list) else tasks,
            capacity=capacity,
            max_partitions=max_partitions,
            lease_timeout=lease_timeout,
            bind=bind,
            secret=secret,
        )
        loop = wire_loop()
        services: list[Server] = []
        ctrl = Controller(config, [])
        try:
            for _ in range(config.storage_units):
                unit = StorageUnit(on_stored=ctrl.published)
                address = config.unit_bind() or default_address("ipc")
                srv = Server(unit.handle, address, secret=secret, forward=True)
                ctrl.register_unit(loop.run(srv.start()))
                services.append(srv)
            loop.run(ctrl.start())
            srv = Server(
                ctrl.handle,
                config.bind or default_address("ipc"),
                secret=secret,
                on_disconnect=ctrl.disconnected,
                tensors=False,
            )
            address = loop.run(srv.start())
            services.append(srv)
        except BaseException:  # what started closes again: a half-started queue holds nothing
            loop.run(ctrl.aclose())
            for s in services:
                loop.run(s.aclose())
            raise
        self._handle(address, secret, services, ctrl)

    def _handle(
        self,
        address: str,
        secret: str | bytes | None,
        services: list[Server],
        controller: Controller | None,
    ) -> None:
        self.address = address
        self._secret = secret
        self._services = services
        self._controller = controller
        self._clients: list[QueueClient] = []
        self._closed = False

    @classmethod
    def start(cls, **options: Any) -> Queue:
        """Deprecated: ``Queue(**options)`` starts an embedded queue."""
        warnings.warn(
            "Queue.start(...) is deprecated: use Queue(...), which starts an embedded queue",
            DeprecationWarning,
            stacklevel=2,
        )
        return cls(**options)

    @classmethod
    def connect(cls, address: str, *, secret: str | bytes | None = None) -> Queue:
        """A handle on a queue served elsewhere (``rlferry serve queue``).

        Raises:
            SchemaError: ``address`` is not a tcp://HOST:PORT or ipc://PATH address.
        """
        q = cls.__new__(cls)
        q._handle(checked_address(address), secret, [], None)
        return q

    def _check_open(self) -> None:
        if self._closed:
            raise QueueClosed("this queue is closed")

    def client(self) -> QueueClient:
        """A sync client (closed with the queue)."""
        self._check_open()
        c = QueueClient(self.address, secret=self._secret)
        self._clients.append(c)
        return c

    def async_client(self) -> AsyncQueueClient:
        """An asyncio client; close it with ``await client.aclose()`` (or ``async with``)."""
        self._check_open()
        return AsyncQueueClient(self.address, secret=self._secret)

    def statistics(self) -> QueueStatistics:
        """Depth per partition and task, leases, waiters, and per storage unit bytes and rates."""
        self._check_open()
        with QueueClient(self.address, secret=self._secret) as c:
            return c.statistics()

    # -- persistence ------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the whole state and data to the directory ``path``, atomically: the files
        go to a new directory renamed to ``path`` once whole (an older ``path`` is replaced).

        Each consumer task's acks are kept; leases are not: what was delivered but not
        acked is delivered again after :meth:`restore`. The files are rlferry's checked
        format (:mod:`rlferry.wire.files`): nothing in them is pickled.

        Raises:
            FileExistsError: ``path`` holds other files than a queue checkpoint's (nothing is
                written; an empty directory is fine).
        """
        self._check_open()
        run = wire_loop().run
        links = Links(self.address, secret=self._secret)
        try:
            with new_directory(path, replaces="controller.rlf") as out:
                state = run(links.ask(Dump(), _DUMP_TIMEOUT))
                info = run(links.ask(Info(), _DUMP_TIMEOUT))
                state["tasks"] = info["tasks"]
                write_file(out / "controller.rlf", state)
                for u in range(len(info["units"])):
                    unit = run(links.unit(u))
                    dump = run(links.call(unit, Dump(), _DATA_TIMEOUT))
                    write_file(out / f"unit-{u}.rlf", dump)
        finally:
            run(links.aclose())

    @classmethod
    def restore(cls, path: str | os.PathLike[str], **options: Any) -> Queue:
        """Start an embedded queue with the state and data :meth:`save` wrote.

        ``options`` are the constructor's; ``tasks`` and ``storage_units`` default to
        the saved ones. ``path`` is the directory :meth:`save` wrote (or, when a save died
        between its two renames, the whole one it left as ``<path>.old``).

        Raises:
            FileFormatError: a file of the checkpoint is not whole (truncated, changed, or
                not rlferry's format), naming the file and what is wrong.
            FileNotFoundError: no checkpoint at ``path``.
            SchemaError: ``storage_units`` differs from the saved number.
        """
        src = whole_directory(path)
        state = read_file(src / "controller.rlf")
        n_units = len(list(src.glob("unit-*.rlf")))
        options.setdefault("tasks", tuple(state["tasks"]))
        options.setdefault("storage_units", n_units)
        if options["storage_units"] != n_units:
            raise SchemaError(
                f"storage_units: expected {n_units} (as saved in {src}), got "
                f"{options['storage_units']} (restore with the saved number of units)"
            )
        q = cls(**options)
        assert q._controller is not None
        run = wire_loop().run
        links = Links(q.address, secret=q._secret)
        try:
            run(_load(q._controller, state))
            for u in range(n_units):
                unit = run(links.unit(u))
                run(links.call(unit, Load(read_file(src / f"unit-{u}.rlf")), _DATA_TIMEOUT))
        except BaseException:
            q.close()
            raise
        finally:
            run(links.aclose())
        return q

    def close(self) -> None:
        """Close the clients made here and stop the services this queue started; a second
        call does nothing."""
        if self._closed:
            return
        self._closed = True
        for c in self._clients:
            c.close()
        self._clients.clear()
        loop = wire_loop()
        if self._controller is not None:
            loop.run(self._controller.aclose())
        for s in self._services:
            loop.run(s.aclose())
        self._services.clear()

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _load(ctrl: Controller, state: dict[str, Any]) -> None:
    ctrl.load(state)
