"""``shm``: bucket buffers in shared memory, for a sender and receivers on one host (CPU).

The sender makes two memfd segments, mapped and touched once; receivers open
them through /proc/PID/fd/N (the wire's own segment opener, with its checks)
and map them once per layout (cached), then read
every bucket where the sender packed it. A receiver's ``load`` gets views of
the mapping: the only copies are the sender's pack and the receiver's load.
"""

from __future__ import annotations

import os

import torch

from rlferry.wire import WireError
from rlferry.wire._shm import _MEMFD_NAME, _Memory, exports

from .._errors import WeightSyncError
from ._base import ReceiverTransport, SenderTransport

__all__ = ["ShmReceiver", "ShmSender"]

_ROUND = 2 << 20


def _tensor(mem: _Memory) -> torch.Tensor:
    return torch.frombuffer(mem.mm, dtype=torch.uint8)


class ShmSender(SenderTransport):
    name = "shm"

    def __init__(self) -> None:
        self._mems: list[_Memory] = []
        self._views: list[torch.Tensor] = []

    def prepare(self, nbytes: int, device: torch.device) -> None:
        if device.type != "cpu":
            raise WeightSyncError(
                f"transport 'shm': expected CPU buffers, got device {str(device)!r} "
                "(use transport 'cuda_ipc' or 'broadcast' for GPU tensors, or device='cpu')"
            )
        if self._mems and self._mems[0].size >= nbytes:
            return
        size = -(-nbytes // _ROUND) * _ROUND
        mems = []
        for _ in range(2):
            fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                mems.append(_Memory(fd, size, own=True))
            except OSError as e:
                os.close(fd)
                raise WeightSyncError(
                    f"cannot allocate {size} bytes of shared memory: {e}"
                ) from None
        self._mems = mems
        self._views = [_tensor(m) for m in mems]
        for v in self._views:
            v.zero_()  # fault the pages in now, not during the first push
        self.generation += 1

    def descriptor(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "buffers": [[m.fd, m.ino, m.size] for m in self._mems],
        }

    def buffer(self, b: int) -> torch.Tensor:
        return self._views[b]

    @property
    def buffer_bytes(self) -> int:
        return sum(m.size for m in self._mems)

    def close(self) -> None:
        self._views = []
        self._mems = []


class ShmReceiver(ReceiverTransport):
    def __init__(self) -> None:
        self._key: tuple[object, ...] = ()
        self._mems: list[_Memory] = []
        self._views: list[torch.Tensor] = []

    def attach(self, desc: dict[str, object], device: torch.device | None) -> list[bytes]:
        try:
            pid = int(desc["pid"])  # type: ignore[call-overload]
            bufs = [(int(f), int(i), int(s)) for f, i, s in desc["buffers"]]  # type: ignore[attr-defined]
        except (KeyError, TypeError, ValueError):
            raise WeightSyncError("malformed setup: bad shm buffers") from None
        key = (pid, *bufs)
        if key == self._key:
            return []
        try:
            mems = [exports.open_remote(pid, fd, ino, size) for fd, ino, size in bufs]
        except WireError as e:
            raise WeightSyncError(f"{e} (transport 'shm' needs the sender on this host)") from None
        self._key, self._mems = key, mems
        self._views = [_tensor(m) for m in mems]
        self.opened += len(mems)
        return []

    def buffer(self, b: int) -> torch.Tensor:
        return self._views[b]

    def close(self) -> None:
        self._views = []
        self._mems = []
        self._key = ()
