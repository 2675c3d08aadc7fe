"""The queue on Ray: storage units as actors in a SPREAD placement group (one CPU bundle
per node by default), the controller in unit 0's actor, named for the job. Clients find
it by the job's name; the payload goes over rlferry's wire, never through Ray.

The controller shares unit 0's process as an embedded queue shares one process: a put
that lands on unit 0 tells the controller in the process, not across one (on 2 cores
that hop cost a put about 0.5 ms), and units of the controller's node reach it over
ipc://. Unit 0 lives and dies with the controller (the queue's state dies with the
controller in any case).

Each service binds the node's address (for other nodes, with the job's secret) and an
ipc:// path (for processes of its node, through shared memory, as an embedded queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from rlferry.errors import RequestError
from rlferry.queue import AsyncQueueClient, QueueClient, QueueConfig
from rlferry.queue.services import ControllerService, StorageService
from rlferry.wire import wire_loop

from ._common import (
    DEATH_GRACE,
    LaunchError,
    Watched,
    actor_name,
    ask,
    check_job,
    deaths,
    namespace_of,
    node_address,
    ray,
    secret,
    taken,
)
from ._placement import READY_TIMEOUT, Placed, place, stop_all

__all__ = ["RayQueue", "async_queue", "queue"]

_CALL_TIMEOUT = 60.0  # a launcher's call to an actor (start, connection) answers within this


async def _on_wire_loop(coro: Any) -> Any:
    """Run ``coro`` on rlferry's wire loop (where the services live, as in any process of
    rlferry: not on Ray's actor loop, which also serves Ray's calls)."""
    return await asyncio.wrap_future(wire_loop().submit(coro))


class _Service(Watched):
    """What the queue's actors share: a service to close."""

    def __init__(self) -> None:
        super().__init__()
        self._service: Any = None

    async def close(self) -> None:
        if self._service is not None:
            await _on_wire_loop(self._service.aclose())
        self._closed.set()


class StorageActor(_Service):
    """A storage unit as an actor: :meth:`start` binds, :meth:`link` names the controller."""

    async def start(self, key: str) -> list[str]:
        async def start() -> list[str]:
            self._service = StorageService([f"tcp://{node_address()}:*", None], key)
            return await self._service.start()

        return list(await _on_wire_loop(start()))

    async def link(self, controller: dict[str, str]) -> None:
        """Tell the controller what this unit stores: over ipc:// from its node, else tcp."""
        here = controller["ip"] == node_address()

        async def link() -> None:
            self._service.link(controller["ipc"] if here else controller["address"])

        await _on_wire_loop(link())


class ControllerActor(StorageActor):
    """The controller and storage unit 0, the job's named actor; it hands clients what they
    need (:meth:`connection`), so no address or secret is passed by hand."""

    def __init__(self) -> None:
        super().__init__()
        self._controller: ControllerService | None = None

    async def start_controller(self, settings: dict[str, Any], units: list[str]) -> list[str]:
        config = QueueConfig(bind=f"tcp://{node_address()}:*", **settings)
        self._info = {"secret": config.secret}

        async def start() -> list[str]:
            self._controller = ControllerService(config, units, [config.bind, None])
            return await self._controller.start()

        return list(await _on_wire_loop(start()))

    def remember(self, info: dict[str, Any]) -> None:
        self._info.update(info)

    def connection(self) -> dict[str, Any]:
        return self._info

    async def close(self) -> None:
        if self._controller is not None:
            await _on_wire_loop(self._controller.aclose())
        await super().close()


def _remote(cls: type, **options: Any) -> Any:
    return ray().remote(cls).options(**options)


class RayQueue(Placed):
    """A queue whose controller and storage units run as Ray actors of the job ``job``.

    Start it once (:meth:`start`, from the driver); any task or actor of the job then
    gets a client with :func:`queue` (``rlferry.ray.queue(job)``), or :meth:`client` here.
    :meth:`close` (also on ``with``'s exit, Ctrl-C included) removes every actor and the
    placement group; if the driver dies, Ray removes them with its job.
    """

    def __init__(self, job: str, namespace: str, actors: list[Any], names: list[str],
                 pg: Any, services: dict[str, dict[str, str]]) -> None:  # fmt: skip
        super().__init__(names, actors, pg)  # the controller (and unit 0), then unit 1, 2, ...
        self.job = job
        self.namespace = namespace
        self.services = services  # by tcp:// address: the actor's name, node, ip, ipc:// path
        self._clients: list[QueueClient] = []

    @classmethod
    def start(
        cls,
        job: str,
        *,
        storage_units: int | None = None,
        tasks: tuple[str, ...] | list[str] = ("train",),
        capacity: int | None = None,
        max_partitions: int | None = None,
        lease_timeout: float = 60.0,
        bundles: list[dict[str, float]] | None = None,
        cpus_per_unit: float = 1.0,
        ready_timeout: float = READY_TIMEOUT,
        namespace: str | None = None,
    ) -> RayQueue:
        """Start the job's queue on the Ray cluster this process is connected to.

        ``storage_units``: how many (default: one per alive node, or one per bundle);
        ``bundles``: the units' placement group bundles, one per unit (default
        ``{"CPU": cpus_per_unit}`` each, spread over the nodes); put units next to
        trainers with a node's resource, e.g. ``{"CPU": 1, "node:10.0.0.7": 0.01}``. The
        other options are :class:`rlferry.queue.Queue`'s. ``namespace``: the Ray
        namespace of the job's names (default: this job's).

        Raises:
            LaunchError: the job's name is taken in the namespace, the units cannot be
                placed within ``ready_timeout`` seconds, or an actor failed to start.
        """
        r = ray()
        check_job(job)
        ns = namespace_of(namespace)
        settings: dict[str, Any] = {
            "tasks": tuple(tasks), "capacity": capacity, "lease_timeout": lease_timeout,
            "max_partitions": max_partitions, "secret": secret(),
        }  # fmt: skip
        QueueConfig(storage_units=1, **settings)  # checked before anything starts
        if bundles is None:
            n = storage_units or sum(1 for node in r.nodes() if node.get("Alive"))
            bundles = [{"CPU": cpus_per_unit} for _ in range(n)]
        elif storage_units is not None and storage_units != len(bundles):
            raise RequestError(
                f"storage_units: expected {len(bundles)} (one per bundle), got {storage_units}"
            )
        ctrl_name = actor_name(job, "controller")
        if taken(ctrl_name, ns):
            raise LaunchError(
                f"job `{job}`: its queue is already running in Ray namespace `{ns}` (actor "
                f"`{ctrl_name}`): close it, or start this one under another job name"
            )
        pg = place(bundles, "SPREAD", name=actor_name(job, "storage"),
                   what=f"job `{job}`: storage units", ready_timeout=ready_timeout)  # fmt: skip
        # unit i in bundle i: unit 0 in the controller's actor, the others storage1, 2, ...
        names = [ctrl_name] + [actor_name(job, f"storage{i}") for i in range(1, len(bundles))]
        actors: list[Any] = []
        try:
            strategy = r.util.scheduling_strategies.PlacementGroupSchedulingStrategy
            for i, bundle in enumerate(bundles):
                actors.append(_remote(
                    ControllerActor if i == 0 else StorageActor, name=names[i], namespace=ns,
                    num_cpus=bundle.get("CPU", 0),
                    scheduling_strategy=strategy(pg, placement_group_bundle_index=i),
                ).remote())  # fmt: skip
            key = settings["secret"]
            units = _gather([a.start.remote(key) for a in actors], f"job `{job}`: storage units")
            ctrl = actors[0]
            (ctrl_addrs,) = _gather([ctrl.start_controller.remote(settings, [u[0] for u in units])],
                                    f"job `{job}`: controller")  # fmt: skip
            places = _gather([a.where.remote() for a in actors], f"job `{job}`: placement")
            link = {"address": ctrl_addrs[0], "ipc": ctrl_addrs[1], "ip": places[0]["ip"]}
            _gather([a.link.remote(link) for a in actors], f"job `{job}`: link")
            services = {
                addrs[0]: {"name": name, "node": at["node"], "ip": at["ip"], "ipc": addrs[1]}
                for name, addrs, at in zip(
                    [ctrl_name, *names], [ctrl_addrs, *units], [places[0], *places], strict=True
                )
            }
            _gather([ctrl.remember.remote({"address": ctrl_addrs[0], "services": services})],
                    f"job `{job}`: controller")  # fmt: skip
        except BaseException as e:
            stop_all(actors, pg)
            if isinstance(e, r.exceptions.ActorDiedError) or "already taken" in str(e):
                raise LaunchError(f"job `{job}`: {e}") from None
            raise
        return cls(job, ns, actors, names, pg, services)

    def client(self) -> QueueClient:
        """A sync client (closed with the queue)."""
        c = queue(self.job, namespace=self.namespace)
        self._clients.append(c)
        return c

    def async_client(self) -> AsyncQueueClient:
        """An asyncio client; close it with ``await client.aclose()``."""
        return async_queue(self.job, namespace=self.namespace)

    def close(self) -> None:
        """Close the clients made here, stop every service, remove the actors and the group."""
        for c in self._clients:
            c.close()
        self._clients.clear()
        self._stop()
        here = node_address()
        for service in self.services.values():  # what a killed actor left on this host
            if service["ip"] == here:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(service["ipc"].removeprefix("ipc://"))

    def __enter__(self) -> RayQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _gather(refs: list[Any], what: str) -> list[Any]:
    r = ray()
    try:
        return list(r.get(refs, timeout=_CALL_TIMEOUT))
    except r.exceptions.GetTimeoutError:
        raise LaunchError(f"{what}: no answer within {_CALL_TIMEOUT:g} s") from None


def queue(job: str, *, namespace: str | None = None, timeout: float = _CALL_TIMEOUT) -> QueueClient:
    """A client of the job's queue, from any task or actor of the job (or any process
    connected to the cluster that names the job's ``namespace``).

    A call that waits on a service whose actor dies raises ``ServiceGone`` naming the
    actor and Ray's reason (``... died: The actor is dead because it was killed by
    `ray.kill`.``).

    Raises:
        LaunchError: no queue of that job in the namespace, or it did not answer.
    """
    return QueueClient(**_connection(job, namespace, timeout))


def async_queue(
    job: str, *, namespace: str | None = None, timeout: float = _CALL_TIMEOUT
) -> AsyncQueueClient:
    """:func:`queue`'s asyncio client; close it with ``await client.aclose()``."""
    return AsyncQueueClient(**_connection(job, namespace, timeout))


def _connection(job: str, namespace: str | None, timeout: float) -> dict[str, Any]:
    """A client's arguments: the controller's address, the secret, and the hooks that
    dial same-node services over ipc:// and name a lost service's actor and cause."""
    r = ray()
    info = ask(job, "controller", "connection", namespace, timeout=timeout,
               start_with="rlferry.ray.RayQueue.start")  # fmt: skip
    ns = namespace_of(namespace)
    services: dict[str, dict[str, str]] = info["services"]
    here = node_address()  # services of this host: over ipc:// (Ray nodes of one host too)
    for service in services.values():
        deaths.watch(service["name"], r.get_actor(service["name"], namespace=ns))

    def dial(address: str) -> str:
        service = services.get(address)
        return service["ipc"] if service is not None and service["ip"] == here else address

    async def why_gone(address: str, message: str) -> str:
        service = services.get(address)
        if service is None:
            return message
        why = await deaths.why(service["name"])
        if why is None:
            return (
                f"{message} (actor `{service['name']}`: Ray reported no death within "
                f"{DEATH_GRACE:g} s)"
            )
        return f"actor `{service['name']}` ({address}) died: {why}"

    return {"address": info["address"], "secret": info["secret"], "dial": dial,
            "why_gone": why_gone}  # fmt: skip
