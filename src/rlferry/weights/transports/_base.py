"""What a transport does on each side: buffers to pack into and load from, or a group.

*Mailbox* transports (shm, cuda_ipc) keep two bucket buffers that the sender
packs into and every receiver maps once; the sender announces each bucket in a
control message and reuses a buffer when every receiver acknowledged it.
*Collective* transports (broadcast) move every bucket with one collective call
per bucket; the control messages only start the stream and collect the results.
"""

from __future__ import annotations

import torch

__all__ = ["ReceiverTransport", "SenderTransport", "checksum"]


def checksum(view: torch.Tensor) -> int:
    """The wrapping sum of the 8-byte words of ``view`` (uint8, length a multiple of 8)."""
    return int(view.view(torch.int64).sum().item())


class SenderTransport:
    """The sender's side; one per sender, made on its first push."""

    name = ""
    collective = False
    generation = 0  # bumps when the buffers (or group) change: receivers must attach again

    def prepare(self, nbytes: int, device: torch.device) -> None:
        """Have two buffers of at least ``nbytes`` on ``device`` (mailbox transports)."""
        raise NotImplementedError

    def descriptor(self) -> dict[str, object]:
        """What a receiver needs to attach to the current buffers (plain data, no pickle)."""
        raise NotImplementedError

    def buffer(self, b: int) -> torch.Tensor:
        raise NotImplementedError

    def receiver_attached(self, key: bytes, handles: list[bytes]) -> None:
        """A receiver attached; ``handles`` are what it sent back (cuda_ipc: its events)."""

    def receiver_left(self, key: bytes) -> None:
        """A receiver is gone or attached again: forget what it sent."""

    def before_pack(self, b: int, keys: list[bytes]) -> None:
        """Buffer ``b`` is free on the CPU's side; order the pack after every receiver's reads."""

    def after_pack(self, b: int) -> None:
        """The pack of buffer ``b`` is issued; let the receivers order their reads after it."""

    @property
    def buffer_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class ReceiverTransport:
    """A receiver's side of a mailbox transport."""

    opened = 0  # buffers mapped or IPC handles opened, ever

    def attach(self, desc: dict[str, object], device: torch.device | None) -> list[bytes]:
        """Map the buffers ``desc`` names (once: cached); returns what the sender needs back."""
        raise NotImplementedError

    def buffer(self, b: int) -> torch.Tensor:
        raise NotImplementedError

    def before_load(self, b: int) -> None:
        """Order the load of buffer ``b`` after the sender's pack."""

    def after_load(self, b: int) -> None:
        """The load of buffer ``b`` is issued; let the sender order its next pack after it."""

    def finish(self) -> None:
        """Wait until every issued load has completed (before a commit)."""

    def close(self) -> None:
        pass
