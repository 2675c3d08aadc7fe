"""The shim's service on Ray: one named actor of the job holds the controller and the store.

``tq.init(conf)`` in the driver starts it (``rlferry/transferqueue/service`` in the job's
Ray namespace, through ``rlferry.ray``'s helpers: a secret made here and handed to the
actor through Ray, the node's address bound for other nodes and an ipc:// path for
processes of its node); ``tq.init()`` or ``get_client()`` in any task or actor of the job
finds it by name and asks it how to connect, as TransferQueue's workers find its
controller. Ray places the actor, names it and reports its death; the payload goes over
rlferry's wire, never through Ray. A request waiting on an actor that dies fails at once
with ``ServiceGone`` naming the actor and Ray's reason.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from rlferry.ray._common import (
    LaunchError,
    Watched,
    actor_name,
    deaths,
    namespace_of,
    node_address,
    ray,
    secret,
)
from rlferry.wire import default_address

from .._config import merged_config
from ..samplers import BaseSampler
from ._backend import Backend, Connection, embedded, remote

__all__ = ["JOB", "ServiceActor", "attach", "start"]

JOB, ROLE = "transferqueue", "service"
_CALL_TIMEOUT = 60.0  # the actor's start and its connection answer within this
_GRACE = 0.5  # seconds a lost connection waits for Ray to say why the actor died


class ServiceActor(Watched):
    """The actor: the shim's service bound to the node's address and to an ipc:// path."""

    def __init__(self) -> None:
        super().__init__()
        self._service: Any = None
        self._info: dict[str, Any] = {}

    async def start(self, conf: dict[str, Any], sampler: BaseSampler, key: str) -> dict[str, Any]:
        from ._service import serve

        final = merged_config(conf)
        self._service, (address, ipc) = await serve(
            embedded(final, sampler, served=True),
            [f"tcp://{node_address()}:*", default_address("ipc")],
            key,
        )
        self._info = {"address": address, "ipc": ipc, "ip": node_address(), "secret": key,
                      "timeout": float(final.controller.get_meta_timeout)}  # fmt: skip
        return self._info

    def connection(self) -> dict[str, Any]:
        return self._info

    async def stop_serving(self) -> None:
        """Close the service's sockets (the actor is removed next: ``until_closed`` fails
        then, and every process that watches it learns why)."""
        if self._service is not None:
            await self._service.close()


def _name() -> str:
    return actor_name(JOB, ROLE)


def start(conf: Any, sampler: BaseSampler) -> Backend:
    """Start the job's service actor and connect to it; if another process of the job
    started it already, connect to that one (``conf`` is then not used).

    Raises:
        LaunchError: the actor could not start, or did not answer.
    """
    r = ray()
    if not r.is_initialized():
        r.init()  # the configuration asked for Ray (as TransferQueue's first actor does)
    existing = attach()
    if existing is not None:
        return existing
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(conf, resolve=True)
    assert isinstance(plain, dict)
    plain["controller"]["sampler"] = type(sampler).__name__  # the instance goes on its own
    options: dict[str, Any] = {"name": _name(), "namespace": namespace_of(None), "num_cpus": 0}
    needed = conf.backend.SimpleStorage.required_node_resource
    if needed is not None:
        have = sorted(r.cluster_resources())
        if str(needed) not in have:  # Ray alone would wait for such a node forever
            raise LaunchError(
                f"config `backend.SimpleStorage.required_node_resource`: expected a resource "
                f"some node of the cluster has, got {needed!r}, which none has (the cluster "
                f"has {have}; start a node with resources={{{str(needed)!r}: 1}}, or unset it)"
            )
        options["resources"] = {str(needed): 0.001}
    else:  # beside the driver: its puts and gets go through shared memory
        near = r.util.scheduling_strategies.NodeAffinitySchedulingStrategy
        options["scheduling_strategy"] = near(r.get_runtime_context().get_node_id(), soft=True)
    try:
        actor = r.remote(ServiceActor).options(**options).remote()
    except ValueError:  # another rank of the job started it meanwhile
        found = attach()
        if found is None:
            raise
        return found
    try:
        info = r.get(actor.start.remote(plain, sampler, secret()), timeout=_CALL_TIMEOUT)
    except BaseException as e:
        r.kill(actor)
        if isinstance(e, r.exceptions.GetTimeoutError):
            raise LaunchError(f"{_name()}: did not start within {_CALL_TIMEOUT:g} s") from None
        raise LaunchError(f"{_name()}: failed to start: {e}") from None
    backend = _connect(actor, info, conf)
    backend.on_close.append(lambda: _stop(actor, info))
    return backend


def attach() -> Backend | None:
    """A backend on the job's service actor, or None if the job has none."""
    r = ray()
    try:
        actor = r.get_actor(_name(), namespace=namespace_of(None))
    except ValueError:
        return None
    try:
        info = r.get(actor.connection.remote(), timeout=_CALL_TIMEOUT)
    except r.exceptions.GetTimeoutError:
        raise LaunchError(f"{_name()}: did not answer in {_CALL_TIMEOUT:g} s") from None
    if not info:
        raise LaunchError(f"{_name()}: found, but not started yet (is its start failing?)")
    return _connect(actor, info, None)


def _connect(actor: Any, info: dict[str, Any], conf: Any) -> Backend:
    name = _name()
    key = f"{name}#{actor._actor_id.hex()}"  # one life of the actor
    deaths.watch(key, actor)

    async def why_gone(message: str) -> str:
        why = await deaths.why(key, _GRACE)
        if why is None:
            return f"{message} (actor `{name}`: Ray reported no death within {_GRACE:g} s)"
        return f"actor `{name}` ({info['address']}) died: {why}"

    connection = Connection(info["address"], info["secret"], info["timeout"], name, key,
                            namespace_of(None))  # fmt: skip
    here = info["ip"] == node_address()  # processes of its node: ipc://, shared memory
    return remote(connection, info["ipc"] if here else info["address"], why_gone, conf)


def _stop(actor: Any, info: dict[str, Any]) -> None:
    """Close the actor's service, then remove the actor; once Ray reports it dead (its name
    is free again), remove what a killed actor leaves on this host (its socket file)."""
    r = ray()
    with contextlib.suppress(r.exceptions.RayError):
        r.get(actor.stop_serving.remote(), timeout=_CALL_TIMEOUT)
    r.kill(actor)
    r.wait([actor.until_closed.remote()], timeout=_CALL_TIMEOUT)
    if info["ip"] == node_address():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(info["ipc"].removeprefix("ipc://"))
