"""``shm`` zero copy: receivers read the trainer's own CPU tensors where they lie.

The sender moves the storages of the pushed tensors into shared memory once,
as ``Tensor.share_memory_()`` does for ``torch.multiprocessing`` (torch's
``_share_fd_cpu_``: a copy into a shared-memory file, then every tensor and
view of the storage uses it; values and tensor objects are unchanged). A
storage already shared that way is used as it is. Receivers open each file
through /proc/PID/fd/N (inode and size checked), map it read-only and close the
descriptor: a ``load`` that wrote into its views would crash, not corrupt the
trainer's weights. The mappings stay while the same tensors are pushed again;
when the last view dies they are unmapped.

The move happens on the first push only: tensors that a later push brings and
that are not shared yet are packed instead (moving them every push would cost
more than packing). Each shared storage keeps one file descriptor open in the
sender (torch's), so a layout of more storages than the descriptor limit
leaves room for is packed too.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import weakref
from typing import Any

import torch

from .._errors import WeightSyncError
from ._base import direct_place

__all__ = ["export_storages", "map_storages", "storage_key"]

_FD_HEADROOM = 256  # descriptors left free for everything else

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _fd_room() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return soft - len(os.listdir("/proc/self/fd")) - _FD_HEADROOM


def export_storages(tensors: list[torch.Tensor], may_move: bool) -> dict[str, Any] | None:
    """What receivers need to map ``tensors`` in place, or None if they cannot be.

    ``tensors`` must be CPU tensors (views of any strides); their storages are moved into
    shared memory if ``may_move`` (else they must be shared already).
    """
    if not all(t.device.type == "cpu" for t in tensors):
        return None
    index: dict[int, int] = {}
    storages: list[torch.UntypedStorage] = []
    for t in tensors:
        st = t.untyped_storage()
        if t.numel() and st.data_ptr() not in index:
            index[st.data_ptr()] = len(storages)
            storages.append(st)
    fresh = [st for st in storages if not st.is_shared()]
    if (fresh and not may_move) or len(fresh) > _fd_room():
        return None
    shared = []
    for st in storages:
        try:
            fd, size = st._share_fd_cpu_()
        except RuntimeError:  # shared some other way (torch's file_system strategy)
            return None
        shared.append([int(fd), os.fstat(fd).st_ino, int(size)])
    index = {st.data_ptr(): i for i, st in enumerate(storages)}  # moved: new addresses
    places = [
        direct_place(t, index[t.untyped_storage().data_ptr()]) if t.numel() else [-1, 0]
        for t in tensors
    ]
    return {"mode": "direct", "pid": os.getpid(), "storages": shared, "tensors": places}


def _map(pid: int, fd: int, ino: int, size: int) -> torch.Tensor:
    """The sender's storage ``fd``, mapped read-only; unmapped when the last view dies."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        newfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise WeightSyncError(
            f"cannot open the sender's tensor memory {path}: {e} (transport 'shm' needs the "
            "sender on this host, same user and pid namespace)"
        ) from None
    try:
        st = os.fstat(newfd)
        if st.st_ino != ino or st.st_size < size:
            raise WeightSyncError(
                f"malformed setup: {path} is not the tensor memory announced (inode {ino}, "
                f"{size} bytes; found inode {st.st_ino}, {st.st_size} bytes)"
            )
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, newfd, 0)
    finally:
        os.close(newfd)
    if addr is None or addr == _MAP_FAILED:
        raise WeightSyncError(
            f"cannot map {size} bytes of the sender's tensor memory: "
            f"{os.strerror(ctypes.get_errno())}"
        )
    arr = (ctypes.c_char * size).from_address(addr)
    weakref.finalize(arr, _libc.munmap, addr, size)
    return torch.frombuffer(arr, dtype=torch.uint8)


def storage_key(desc: dict[str, object]) -> tuple[Any, ...]:
    """``("direct", pid, (fd, inode, size), ...)``: what to map, and the key of the cache."""
    try:
        pid = int(desc["pid"])  # type: ignore[call-overload]
        storages = [(int(f), int(i), int(s)) for f, i, s in desc["storages"]]  # type: ignore[attr-defined]
    except (KeyError, TypeError, ValueError):
        raise WeightSyncError("malformed setup: bad shm tensor storages") from None
    return ("direct", pid, *storages)


def map_storages(key: tuple[Any, ...]) -> list[torch.Tensor]:
    """Map every storage of ``key`` (from :func:`storage_key`), as byte tensors."""
    pid = key[1]
    return [_map(pid, *s) for s in key[2:]]
