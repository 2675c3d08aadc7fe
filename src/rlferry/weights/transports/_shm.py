"""``shm``: bucket buffers in shared memory, for a sender and receivers on one host (CPU).

Zero copy (``_shm_direct``): when the pushed tensors are contiguous CPU tensors
and the input is re-iterable, their storages are moved into shared memory once
and receivers read them in place: the only copy is the receiver's load.

Packed (a generator, ``verify``, ``zero_copy=False``, or tensors that cannot be
shared): the sender makes two memfd segments, mapped and touched once;
receivers open them through /proc/PID/fd/N (the wire's own segment opener, with
its checks) and map them once per layout (cached), then read every bucket where
the sender packed it. A receiver's ``load`` gets views of the mapping: the only
copies are the sender's pack and the receiver's load.
"""

from __future__ import annotations

import os

import torch

from rlferry.wire import WireError
from rlferry.wire.lowlevel import MEMFD_NAME, Memory, exports

from .._errors import WeightSyncError
from ._base import MailboxReceiver, MailboxSender, direct_views
from ._shm_direct import export_storages, map_storages, storage_key

__all__ = ["ShmReceiver", "ShmSender"]

_ROUND = 2 << 20


def _tensor(mem: Memory) -> torch.Tensor:
    return torch.frombuffer(mem.mm, dtype=torch.uint8)


class ShmSender(MailboxSender):
    name = "shm"

    def __init__(self) -> None:
        self._mems: list[Memory] = []
        self._views: list[torch.Tensor] = []
        self.direct = False
        self._held: list[torch.Tensor] = []  # the last direct push's tensors, kept alive
        self._ptrs: list[int] = []
        self._direct_desc: dict[str, object] = {}
        self._moved = False  # a direct push moved tensors into shared memory
        self._moved_before = False  # ... before the current push

    @staticmethod
    def _check(device: torch.device) -> None:
        if device.type != "cpu":
            raise WeightSyncError(
                f"transport 'shm': expected CPU buffers, got device {str(device)!r} "
                "(use transport 'cuda_ipc' or 'broadcast' for GPU tensors, or device='cpu')"
            )

    def use_direct(self, tensors: list[torch.Tensor], device: torch.device) -> bool:
        """Let receivers read ``tensors`` in place (no pack), if they all can be (see
        ``_shm_direct``); while the same tensors are pushed again nothing is exported anew."""
        self._check(device)
        self._moved_before = self._moved
        ptrs = [t.data_ptr() for t in tensors]
        if self.direct and ptrs == self._ptrs:
            self._held = tensors
            return True
        desc = export_storages(tensors, may_move=not self._moved)
        ok = desc is not None
        if ok or self.direct:
            self.generation += 1
        self.direct, self._direct_desc = ok, desc or {}
        if ok:
            self._moved = True
            self._held, self._ptrs = tensors, [t.data_ptr() for t in tensors]
            self._mems, self._views = [], []  # the packing buffers are not needed
        else:
            self._held, self._ptrs = [], []
        return ok

    def use_packed(self) -> None:
        """This push is packed into the buffers (a generator, verify, or zero_copy off)."""
        self._moved_before = self._moved
        if self.direct:
            self.direct, self._held, self._ptrs, self._direct_desc = False, [], [], {}
            self.generation += 1

    def abandon(self) -> None:
        """A failed push's move does not count as the first push's: the tensors of the
        next push may still be moved into shared memory (those it moved stay shared)."""
        self._moved = self._moved_before

    def ready(self, tensors: list[torch.Tensor], keys: list[bytes]) -> None:
        """Direct mode: the tensors are written by this thread, before the announcements."""

    def prepare(self, nbytes: int, device: torch.device) -> None:
        self._check(device)
        if self.direct or (self._mems and self._mems[0].size >= nbytes):
            return
        size = -(-nbytes // _ROUND) * _ROUND
        mems = []
        for _ in range(2):
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                mems.append(Memory(fd, size, own=True))
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
        if self.direct:
            return self._direct_desc
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
        self._held = []


class ShmReceiver(MailboxReceiver):
    def __init__(self) -> None:
        self._key: tuple[object, ...] = ()
        self._mems: list[Memory] = []
        self._views: list[torch.Tensor] = []
        self._storages: list[torch.Tensor] = []  # direct: the sender's storages, mapped
        self.direct = False
        self.tensors: list[torch.Tensor] = []  # direct: each pushed tensor's bytes
        self.strides: list[list[int] | None] = []  # direct: and its strides

    def attach(self, desc: dict[str, object], device: torch.device | None) -> list[bytes]:
        self.direct = desc.get("mode") == "direct"
        if self.direct:
            key = storage_key(desc)
            if key != self._key:
                self._storages, self._views, self._mems = map_storages(key), [], []
                self._key = key
                self.opened += len(self._storages)
            self.tensors, self.strides = direct_views(desc, self._storages, "shm")
            return []
        self.tensors, self._storages = [], []
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
        self._storages, self.tensors = [], []
        self._key = ()
