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

from ._common import ask, check_job, node_address

__all__ = ["weight_sender"]


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
        LaunchError: the job has no engines in the namespace, or they did not answer.
    """
    check_job(job)
    if transport != "broadcast":
        return WeightSender(group=group, transport=transport, receivers=receivers, **options)
    key = ask(job, "engine0", "weights_secret", namespace,
              start_with="rlferry.ray.RayEngines.start")  # fmt: skip
    return WeightSender(group=group, transport="broadcast", receivers=receivers,
                        bind=f"tcp://{node_address()}:0", secret=key, **options)  # fmt: skip
