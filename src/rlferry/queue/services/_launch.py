"""The queue's services as a launcher runs them: :class:`ControllerService` and
:class:`StorageService` (for ``rlferry.ray`` or one's own launcher), and
:func:`serve_queue` (``rlferry serve queue``: the controller in this process, each
storage unit in a child process).

The config is checked here, before any child starts. A child reports its bound
address, or the error that stopped it, through its pipe; the parent waits on the
pipe and on the child's death at once, so a unit that dies at start is reported
with its own error, not after a timeout.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import signal
import sys
from multiprocessing.connection import Connection, wait
from typing import Any

from rlferry.wire import AsyncClient, Server, default_address
from rlferry.wire.lowlevel import AsyncResource

from .._config import QueueConfig
from .._errors import QueueClosed, ServiceGone
from .._messages import Produced, to_wire
from ..statistics import ControllerStatistics, StorageStatistics
from ._controller import Controller
from ._storage import StorageUnit

__all__ = ["UNIT_START_TIMEOUT", "ControllerService", "StorageService", "serve_queue"]

_PUBLISH_TIMEOUT = 30.0
UNIT_START_TIMEOUT = 120.0
"""Seconds a storage unit process may take to start (it imports torch)."""


class StorageService(AsyncResource):
    """A storage unit served on its own (a process, or an actor of a launcher): it binds at
    :meth:`start`, then, once :meth:`link` names the controller, tells it what it stored.

    ``binds``: where it listens (None: a fresh ipc:// path); the first bound address is
    the one the controller knows it by. Off loopback it needs ``secret``.

    Lifecycle: made on a running loop; ``await start()`` binds; ``await aclose()``
    (idempotent) stops serving and lets go of the payload. ``async with`` starts it and
    closes it on exit.
    """

    def __init__(self, binds: list[str | None], secret: str | bytes | None) -> None:
        self._link: asyncio.Future[AsyncClient] = asyncio.get_running_loop().create_future()
        self._secret = secret
        self._closed = False
        self.unit = unit = StorageUnit(self._published)
        self._servers = [
            Server(unit.handle, b or default_address("ipc"), secret=secret, forward=True)
            for b in binds
        ]

    async def _published(self, partition: str, indexes: list[int], fields: list[str]) -> None:
        msg = to_wire(Produced(partition, indexes, fields))
        await (await self._link).request(msg, timeout=_PUBLISH_TIMEOUT)

    async def start(self) -> list[str]:
        """Bind; the addresses bound, in the order of ``binds``.

        Raises:
            QueueClosed: the service was closed.
        """
        if self._closed:
            raise QueueClosed("this storage service is closed")
        try:
            return [await srv.start() for srv in self._servers]
        except BaseException:
            await self.aclose()
            raise

    def link(self, controller: str) -> None:
        """From now on, tell the controller at ``controller`` what this unit stored."""
        self._link.set_result(AsyncClient(controller, secret=self._secret))

    def statistics(self) -> StorageStatistics:
        return self.unit.statistics()

    async def __aenter__(self) -> StorageService:
        await self.start()
        return self

    async def aclose(self) -> None:
        """Stop serving and let go of the payload; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for srv in self._servers:
            await srv.aclose()
        if self._link.done():
            await self._link.result().aclose()
        else:
            self._link.cancel()
        await self.unit.aclose()


class ControllerService(AsyncResource):
    """The controller served at ``binds`` (None: a fresh ipc:// path; the first address is
    the one to hand to clients), over storage units already bound at ``units``.

    Lifecycle: ``await start()`` binds; ``await aclose()`` (idempotent) stops serving.
    ``async with`` starts it and closes it on exit.
    """

    def __init__(self, config: QueueConfig, units: list[str], binds: list[str | None]) -> None:
        self._closed = False
        self.controller = Controller(config, units)
        self._servers = [
            Server(
                self.controller.handle,
                b or default_address("ipc"),
                secret=config.secret,
                on_disconnect=self.controller.disconnected,
                tensors=False,
            )
            for b in binds
        ]

    async def start(self) -> list[str]:
        """Watch the units and bind; the addresses bound, in the order of ``binds``.

        Raises:
            QueueClosed: the service was closed.
        """
        if self._closed:
            raise QueueClosed("this controller service is closed")
        try:
            await self.controller.start()
            return [await srv.start() for srv in self._servers]
        except BaseException:
            await self.aclose()
            raise

    def statistics(self) -> ControllerStatistics:
        return self.controller.statistics()

    async def __aenter__(self) -> ControllerService:
        await self.start()
        return self

    async def aclose(self) -> None:
        """Stop serving and close the controller; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        await self.controller.aclose()
        for srv in self._servers:
            await srv.aclose()


def _run_unit(bind: str | None, secret: str | bytes | None, conn: Connection) -> None:
    async def main() -> None:
        service = StorageService([bind], secret)
        conn.send(["ok", (await service.start())[0]])
        service.link(await asyncio.to_thread(conn.recv))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_reader(conn.fileno(), stop.set)  # the pipe ends with the server: so does this unit
        await stop.wait()
        await service.aclose()

    try:
        asyncio.run(main())
    except Exception as e:  # the parent prints it: a unit that cannot start says why
        conn.send(["error", f"{type(e).__name__}: {e}"])
        sys.exit(1)


def _started(i: int, proc: Any, conn: Connection) -> str:
    """The address unit ``i`` bound, once it says so; its error if it failed or died first."""
    ready = wait([conn, proc.sentinel], UNIT_START_TIMEOUT)
    if not ready:
        raise ServiceGone(
            f"storage unit {i} did not start within {UNIT_START_TIMEOUT:g} s (a slow machine "
            "importing torch, or a hung start)"
        )
    if conn in ready:
        try:
            status, text = conn.recv()
        except EOFError:  # it died: its end of the pipe closed
            status, text = "", ""
        if status == "ok":
            return str(text)
        if status == "error":
            raise ServiceGone(f"storage unit {i} failed to start: {text}")
    proc.join(5)  # it is dead: its exit code
    raise ServiceGone(
        f"storage unit {i} died at start (exit code {proc.exitcode}) before saying why"
    )


def serve_queue(config: QueueConfig) -> None:
    """Serve until SIGINT/SIGTERM. Prints one line per service: ``controller ADDRESS`` first.

    Raises:
        ServiceGone: a storage unit failed to start (its error is in the message).
    """
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    units: list[str] = []
    conns: list[Connection] = []
    try:
        for i in range(config.storage_units):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_run_unit,
                args=(config.unit_bind(), config.secret, child),
                name=f"rlferry-storage-{i}",
                daemon=True,
            )
            proc.start()
            child.close()  # the child's end lives in the child only: its death closes the pipe
            procs.append(proc)
            units.append(_started(i, proc, parent))
            conns.append(parent)

        async def main() -> None:
            service = ControllerService(config, units, [config.bind])
            (address,) = await service.start()
            for conn in conns:  # each unit tells the controller what it stored
                conn.send(address)
            print(f"controller {address}", flush=True)
            for i, (proc, address) in enumerate(zip(procs, units, strict=True)):
                print(f"storage {i} pid {proc.pid} {address}", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            await service.aclose()

        asyncio.run(main())
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(10)
        sys.stdout.flush()
