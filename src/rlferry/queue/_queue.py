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
import struct
from pathlib import Path
from typing import Any

from rlferry.wire import Server, default_address, wire_loop
from rlferry.wire import decode as wire_decode
from rlferry.wire import encode as wire_encode

from ._checks import checked_address
from ._client import AsyncQueueClient, QueueClient
from ._config import QueueConfig
from ._controller import Controller
from ._errors import SchemaError
from ._messages import Dump, Info, Load
from ._storage import StorageUnit

__all__ = ["Queue"]


class Queue:
    """A rollout queue: partitions of samples, fields as columns, tasks that each read all once.

    Use :meth:`start` for an embedded queue, :meth:`connect` for one served by
    ``rlferry serve queue``, :meth:`restore` to resume from :meth:`save`.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: str | bytes | None = None,
        services: list[Server] | None = None,
        controller: Controller | None = None,
    ) -> None:
        self.address = address
        self._secret = secret
        self._services = services or []
        self._controller = controller
        self._clients: list[QueueClient] = []

    @classmethod
    def start(
        cls,
        *,
        storage_units: int = 2,
        tasks: tuple[str, ...] | list[str] = ("train",),
        capacity: int | None = None,
        max_partitions: int | None = None,
        lease_timeout: float = 60.0,
        bind: str | None = None,
        secret: str | bytes | None = None,
    ) -> Queue:
        """Start a controller and ``storage_units`` storage units in this process.

        The options are :class:`QueueConfig`'s (checked before anything starts):
        ``tasks``, the consumers that each read every sample once (e.g.
        ``("actor_train", "critic_train")``); ``capacity``, samples held at most;
        ``max_partitions``, unfinished partitions at most (the staleness bound); a
        put over either waits for room. ``lease_timeout``: seconds a got batch
        stays leased without an ack before it is delivered again. ``bind``: the
        controller's address (default a fresh ipc:// path); off loopback it needs
        ``secret``.
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
        try:
            ctrl = Controller(config, [])
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
        except BaseException:
            for s in services:
                loop.run(s.close())
            raise
        return cls(address, secret=secret, services=services, controller=ctrl)

    @classmethod
    def connect(cls, address: str, *, secret: str | bytes | None = None) -> Queue:
        """A handle on a queue served elsewhere (``rlferry serve queue``).

        Raises:
            SchemaError: ``address`` is not a tcp://HOST:PORT or ipc://PATH address.
        """
        return cls(checked_address(address), secret=secret)

    def client(self) -> QueueClient:
        """A sync client (closed with the queue)."""
        c = QueueClient(self.address, secret=self._secret)
        self._clients.append(c)
        return c

    def async_client(self) -> AsyncQueueClient:
        """An asyncio client; close it with ``await client.close()``."""
        return AsyncQueueClient(self.address, secret=self._secret)

    def statistics(self) -> dict[str, Any]:
        with QueueClient(self.address, secret=self._secret) as c:
            return c.statistics()

    # -- persistence ------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the whole state and data to the directory ``path`` (leases are not kept:
        leased samples are delivered again after :meth:`restore`)."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        run = wire_loop().run
        with QueueClient(self.address, secret=self._secret) as c:
            cc = c._client
            state = run(cc._call(cc._controller, Dump(), 60))
            info = run(cc._call(cc._controller, Info(), 60))
            state["tasks"] = info["tasks"]
            _write(out / "controller.rlf", state)
            for u in range(len(info["units"])):
                unit = run(cc._unit(u))
                _write(out / f"unit-{u}.rlf", run(cc._call(unit, Dump(), 600)))

    @classmethod
    def restore(cls, path: str | os.PathLike[str], **start: Any) -> Queue:
        """Start an embedded queue with the state and data :meth:`save` wrote.

        ``start`` takes :meth:`start`'s options; ``tasks`` and ``storage_units``
        default to the saved ones.
        """
        src = Path(path)
        state = _read(src / "controller.rlf")
        n_units = len(list(src.glob("unit-*.rlf")))
        start.setdefault("tasks", tuple(state["tasks"]))
        start.setdefault("storage_units", n_units)
        if start["storage_units"] != n_units:
            raise SchemaError(
                f"storage_units: expected {n_units} (as saved in {src}), got "
                f"{start['storage_units']} (restore with the saved number of units)"
            )
        q = cls.start(**start)
        assert q._controller is not None
        loop = wire_loop()
        loop.run(_load(q._controller, state))
        with QueueClient(q.address, secret=q._secret) as c:
            cc = c._client
            for u in range(n_units):
                unit = loop.run(cc._unit(u))
                loop.run(cc._call(unit, Load(_read(src / f"unit-{u}.rlf")), 600))
        return q

    def close(self) -> None:
        """Close the clients made here and stop the services this queue started."""
        for c in self._clients:
            c.close()
        self._clients.clear()
        loop = wire_loop()
        if self._controller is not None:
            loop.run(self._controller.close())
        for s in self._services:
            loop.run(s.close())
        self._services.clear()

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _load(ctrl: Controller, state: dict[str, Any]) -> None:
    ctrl.load(state)


def _write(path: Path, value: Any) -> None:
    frames = [memoryview(f).cast("B") for f in wire_encode(value)]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(frames)))
        f.write(struct.pack(f"<{len(frames)}Q", *(m.nbytes for m in frames)))
        for m in frames:
            f.write(m)
    os.replace(tmp, path)


def _read(path: Path) -> Any:
    data = bytearray(path.read_bytes())
    view = memoryview(data)
    (count,) = struct.unpack_from("<Q", view, 0)
    sizes = struct.unpack_from(f"<{count}Q", view, 8)
    at = 8 + 8 * count
    frames = []
    for n in sizes:
        frames.append(view[at : at + n])
        at += n
    return wire_decode(frames)
