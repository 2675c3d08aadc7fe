"""The ways bucket bytes move: ``shm``, ``cuda_ipc``, ``broadcast``."""

from __future__ import annotations

from typing import Any

from ._base import ReceiverTransport, SenderTransport

__all__ = ["ReceiverTransport", "SenderTransport", "make_receiver", "make_sender"]


def make_sender(name: str, bind: str | None, secret: str | bytes | None) -> SenderTransport:
    if name == "shm":
        from ._shm import ShmSender

        return ShmSender()
    if name == "cuda_ipc":
        from ._cuda_ipc import CudaIpcSender

        return CudaIpcSender()
    from ._broadcast import BroadcastSender

    return BroadcastSender(bind, secret)


def make_receiver(name: str) -> Any:
    if name == "shm":
        from ._shm import ShmReceiver

        return ShmReceiver()
    if name == "cuda_ipc":
        from ._cuda_ipc import CudaIpcReceiver

        return CudaIpcReceiver()
    from ._broadcast import BroadcastReceiver

    return BroadcastReceiver()
