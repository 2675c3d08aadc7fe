"""The ways bucket bytes move: ``shm``, ``cuda_ipc`` (mailboxes), ``broadcast`` (a collective)."""

from __future__ import annotations

from ._base import (
    CollectiveReceiver,
    CollectiveSender,
    MailboxReceiver,
    MailboxSender,
    ReceiverTransport,
    SenderTransport,
)

__all__ = [
    "CollectiveReceiver",
    "CollectiveSender",
    "MailboxReceiver",
    "MailboxSender",
    "ReceiverTransport",
    "SenderTransport",
    "make_receiver",
    "make_sender",
]


def make_sender(
    name: str, bind: str | None, secret: str | bytes | None, *, nccl_high_priority: bool = True
) -> MailboxSender | CollectiveSender:
    """The sender's side of transport ``name``; ``bind`` and ``secret``: the control
    channel's (a broadcast group meets where it does); ``nccl_high_priority``: the
    priority of a broadcast group's NCCL streams (see ``WeightSender``)."""
    if name == "shm":
        from ._shm import ShmSender

        return ShmSender()
    if name == "cuda_ipc":
        from ._cuda_ipc import CudaIpcSender

        return CudaIpcSender()
    from ._distributed_sender import DistributedSender

    return DistributedSender(bind, secret, high_priority=nccl_high_priority)


def make_receiver(name: str) -> MailboxReceiver | CollectiveReceiver:
    """A receiver's side of transport ``name`` (the one its sender's ``Welcome`` names)."""
    if name == "shm":
        from ._shm import ShmReceiver

        return ShmReceiver()
    if name == "cuda_ipc":
        from ._cuda_ipc import CudaIpcReceiver

        return CudaIpcReceiver()
    from ._distributed_receiver import DistributedReceiver

    return DistributedReceiver()
