"""Weights across actors: the trainer's ``WeightSender`` for the job's engine actors.

For ``broadcast`` (NCCL on CUDA tensors, gloo on CPU ones) the sender binds this node's
address with the secret the engines were given: the rendezvous (the sender's node
address, a free port, the world size of ``receivers + 1``) goes through that
authenticated channel, and engines on any node join it by the address alone. For
``cuda_ipc`` (a trainer and its engines on one GPU, matched by UUID whatever each
actor's ``CUDA_VISIBLE_DEVICES``) and ``shm`` (one host) nothing leaves the host.
"""

from __future__ import annotations

from typing import Any

from rlferry.weights import WeightSender

from ._common import LaunchError, actor_name, check_job, namespace_of, node_address, ray

__all__ = ["weight_sender"]

_CALL_TIMEOUT = 60.0


def weight_sender(
    job: str,
    *,
    group: str,
    receivers: int,
    transport: str = "broadcast",
    namespace: str | None = None,
    **options: Any,
) -> WeightSender:
    """A ``WeightSender`` for the engines of ``job`` (``RayEngines.start(job, ...)``), from
    any actor or task of the job; ``options`` are ``WeightSender``'s (``device``,
    ``bucket_bytes``, ...). Engines join it with ``init_weight_transfer(group,
    sender.address)``.

    Raises:
        LaunchError: the job has no engines in the namespace.
    """
    r = ray()
    check_job(job)
    if transport != "broadcast":
        return WeightSender(group=group, transport=transport, receivers=receivers, **options)
    ns = namespace_of(namespace)
    name = actor_name(job, "engine0")
    try:
        engine = r.get_actor(name, namespace=ns)
        key = r.get(engine.weights_secret.remote(), timeout=_CALL_TIMEOUT)
    except ValueError:
        raise LaunchError(
            f"job `{job}`: no engines in Ray namespace `{ns}` (no actor `{name}`: start them "
            "with rlferry.ray.RayEngines.start, or pass the job's namespace=)"
        ) from None
    return WeightSender(group=group, transport="broadcast", receivers=receivers,
                        bind=f"tcp://{node_address()}:0", secret=key, **options)  # fmt: skip
