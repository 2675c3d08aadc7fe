"""``cuda_ipc``: bucket buffers on one GPU, shared with engine processes on the same GPU.

The sender allocates two buffers and exports their CUDA IPC handles once per
layout; each receiver opens them once (cached) and reads every bucket where
the sender packed it: no per-step handle opening. Ordering stays on the GPU:
the sender records an interprocess event after packing a buffer and each
receiver's load stream waits on it; each receiver records its own event after
issuing its load, and the sender's stream waits on those before packing that
buffer again. Neither CPU waits for the GPU until the receiver's commit.

Handle fields travel as plain bytes and ints (torch's own IPC rebuild, fed
from our message), never pickled.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import WeightSyncError
from ._base import ReceiverTransport, SenderTransport

__all__ = ["CudaIpcReceiver", "CudaIpcSender"]


def _share(buf: torch.Tensor) -> list[Any]:
    device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = (
        buf.untyped_storage()._share_cuda_()
    )
    return [int(device), bytes(handle), int(size), int(offset), bytes(rc_handle), int(rc_offset),
            bytes(ev_handle) if ev_handle else b"", bool(ev_sync)]  # fmt: skip


def _open(fields: list[Any]) -> torch.Tensor:
    device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = fields
    storage = torch.UntypedStorage._new_shared_cuda(
        int(device), bytes(handle), int(size), int(offset), bytes(rc_handle), int(rc_offset),
        bytes(ev_handle) if ev_handle else None, bool(ev_sync),
    )  # fmt: skip
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage)


class CudaIpcSender(SenderTransport):
    name = "cuda_ipc"

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []
        self._packed: list[torch.cuda.Event] = []
        self._shared: list[list[Any]] = []
        self._consumed: dict[bytes, list[torch.cuda.Event]] = {}

    def prepare(self, nbytes: int, device: torch.device) -> None:
        if device.type != "cuda":
            raise WeightSyncError(
                f"transport 'cuda_ipc': expected CUDA tensors, got device {str(device)!r} "
                "(use transport 'shm' for CPU tensors)"
            )
        if self._bufs and self._bufs[0].device == device and self._bufs[0].numel() >= nbytes:
            return
        self._bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        with torch.cuda.device(device):
            self._packed = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            for ev in self._packed:
                ev.record()
        self._shared = [_share(b) for b in self._bufs]
        self._consumed = {}
        self.generation += 1

    def descriptor(self) -> dict[str, object]:
        return {
            "buffers": self._shared,
            "events": [bytes(ev.ipc_handle()) for ev in self._packed],
            "device": self._bufs[0].device.index,
        }

    def buffer(self, b: int) -> torch.Tensor:
        return self._bufs[b]

    def receiver_attached(self, key: bytes, handles: list[bytes]) -> None:
        if len(handles) != 2:
            raise WeightSyncError("malformed acknowledgement: expected 2 event handles")
        dev = self._bufs[0].device
        self._consumed[key] = [torch.cuda.Event.from_ipc_handle(dev, h) for h in handles]

    def receiver_left(self, key: bytes) -> None:
        self._consumed.pop(key, None)

    def before_pack(self, b: int, keys: list[bytes]) -> None:
        stream = torch.cuda.current_stream(self._bufs[b].device)
        for key in keys:
            events = self._consumed.get(key)
            if events is not None:
                stream.wait_event(events[b])

    def after_pack(self, b: int) -> None:
        self._packed[b].record(torch.cuda.current_stream(self._bufs[b].device))

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self._bufs)

    def close(self) -> None:
        self._bufs, self._packed, self._consumed = [], [], {}


class CudaIpcReceiver(ReceiverTransport):
    def __init__(self) -> None:
        self._key: tuple[bytes, ...] = ()
        self._bufs: list[torch.Tensor] = []
        self._packed: list[torch.cuda.Event] = []
        self._consumed: list[torch.cuda.Event] = []
        self._stream: torch.cuda.Stream | None = None

    def attach(self, desc: dict[str, object], device: torch.device | None) -> list[bytes]:
        try:
            shared: list[list[Any]] = desc["buffers"]  # type: ignore[assignment]
            events = [bytes(h) for h in desc["events"]]  # type: ignore[attr-defined]
            index = int(desc["device"])  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError):
            raise WeightSyncError("malformed setup: bad cuda_ipc buffers") from None
        dev = torch.device("cuda", index)
        if device is not None and device != dev:
            raise WeightSyncError(
                f"transport 'cuda_ipc': the sender's buffers are on cuda:{index}, this receiver's "
                f"device is {str(device)!r} (cuda_ipc shares one GPU; use 'broadcast' across GPUs)"
            )
        key = tuple(bytes(s[1]) for s in shared) + tuple(events)
        if key != self._key:
            try:
                with torch.cuda.device(dev):
                    self._bufs = [_open(s) for s in shared]
                    self._packed = [torch.cuda.Event.from_ipc_handle(dev, h) for h in events]
            except RuntimeError as e:
                raise WeightSyncError(
                    f"cannot open the sender's CUDA IPC buffers: {e} (the sender must be another "
                    "process on the same GPU)"
                ) from None
            self._key = key
            self.opened += len(self._bufs)
        with torch.cuda.device(dev):
            self._stream = torch.cuda.Stream(dev)
            self._consumed = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            for ev in self._consumed:
                ev.record(self._stream)
        return [bytes(ev.ipc_handle()) for ev in self._consumed]

    @property
    def stream(self) -> torch.cuda.Stream | None:
        return self._stream

    def buffer(self, b: int) -> torch.Tensor:
        return self._bufs[b]

    def before_load(self, b: int) -> None:
        assert self._stream is not None
        self._stream.wait_event(self._packed[b])

    def after_load(self, b: int) -> None:
        assert self._stream is not None
        self._consumed[b].record(self._stream)

    def finish(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        self.finish()
        self._bufs, self._packed, self._consumed = [], [], []
        self._key = ()
