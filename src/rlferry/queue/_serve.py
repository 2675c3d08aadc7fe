"""``rlferry serve queue``: the controller in this process, each storage unit in a child process."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

from rlferry.wire import AsyncClient, Server, default_address

from ._controller import Controller
from ._storage import StorageUnit

__all__ = ["serve_queue"]

_PUBLISH_TIMEOUT = 30.0


def _unit_address(bind: str) -> str:
    if bind.startswith("tcp://"):
        return bind.rsplit(":", 1)[0] + ":*"
    return default_address("ipc")


def _run_unit(bind: str, secret: str | None, conn: Connection) -> None:
    async def main() -> None:
        link: asyncio.Future[AsyncClient] = asyncio.get_running_loop().create_future()

        async def published(partition: str, indexes: list[int], fields: list[str]) -> None:
            args = {"partition": partition, "indexes": indexes, "fields": fields}
            await (await link).request(["produced", args], timeout=_PUBLISH_TIMEOUT)

        srv = Server(StorageUnit(published).handle, bind, secret=secret, forward=True)
        conn.send(await srv.start())
        link.set_result(AsyncClient(await asyncio.to_thread(conn.recv), secret=secret))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_reader(conn.fileno(), stop.set)  # the pipe ends with the server: so does this unit
        await stop.wait()
        await srv.close()
        await (await link).close()

    asyncio.run(main())


def serve_queue(
    *,
    storage_units: int,
    bind: str | None,
    secret: str | None,
    tasks: tuple[str, ...],
    capacity: int | None,
    max_partitions: int | None,
    lease_timeout: float,
) -> None:
    """Serve until SIGINT/SIGTERM. Prints one line per service: ``controller ADDRESS`` first."""
    bind = bind or default_address("ipc")
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    units: list[str] = []
    conns: list[Connection] = []
    try:
        for i in range(storage_units):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_run_unit,
                args=(_unit_address(bind), secret, child),
                name=f"rlferry-storage-{i}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
            if not parent.poll(120):
                raise RuntimeError(f"storage unit {i} did not start within 120 s")
            units.append(parent.recv())
            conns.append(parent)

        async def main() -> None:
            ctrl = Controller(
                tasks,
                units,
                capacity=capacity,
                max_partitions=max_partitions,
                lease_timeout=lease_timeout,
                secret=secret,
            )
            await ctrl.start()
            srv = Server(ctrl.handle, bind, secret=secret)
            address = await srv.start()
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
            await ctrl.close()
            await srv.close()

        asyncio.run(main())
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(10)
        sys.stdout.flush()
