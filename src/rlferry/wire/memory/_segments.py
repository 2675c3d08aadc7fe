"""Shared memory between processes of one host: this process's segments, what it lent to
peers, and tensors allocated in it.

A *segment* is a memfd from this process's pool, mapped and kept warm. Over ipc://
the bulk frames of a message travel through segments (``_bulk.py``): the sender
copies a frame into one, or refers to shared memory it already holds; the receiver
maps it (once, then cached) and decodes tensors as views of it.

Every such send is an *export* that keeps its memory alive. When the
receiver's views are all gone (the tensors were freed), it sends a release
naming the export, and the segment returns to the sender's pool. If the peer
disconnects, its exports are dropped: segments it may still map are retired,
never reused. So memory is never overwritten while someone reads it.

Linux only (memfd, /proc/PID/fd); elsewhere ipc:// frames travel through the
socket like tcp:// ones.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from .._errors import WireError
from ._copies import copy_many, in_order

__all__ = [
    "ALIGN",
    "AVAILABLE",
    "BULK_MIN",
    "MEMFD_NAME",
    "Memory",
    "Registry",
    "SharedMemoryStatistics",
    "Use",
    "aligned",
    "exports",
    "shared_copies",
    "shared_empty",
]

AVAILABLE = hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")
BULK_MIN = 64 * 1024  # smaller frames are cheaper through the socket
ALIGN = 256
_ROUND = 2 << 20
MEMFD_NAME = "rlferry-bulk"
_POOL_IDLE_MAX = 4 << 30  # free segment bytes kept warm for reuse
_MAPPINGS_KEPT = 8  # remote segments kept mapped after their last view died


class SharedMemoryStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """This process's shared memory (:meth:`Registry.statistics`)."""

    segments: int
    """Pool segments of this process, lent or free."""
    segment_bytes: int
    """Their bytes."""
    free_bytes: int
    """Bytes of the free segments, kept warm for reuse."""
    exports: int
    """Sends whose memory a peer may still read (not released yet)."""
    mapped_remote: int
    """Peers' segments mapped in this process."""


class Memory:
    """A mapped memfd: one of our pool segments, or a peer's that we opened.

    The fd stays open while the object lives (peers open ours through
    /proc/PID/fd); the mapping goes when the last view of it is gone.
    """

    def __init__(self, fd: int, size: int, own: bool) -> None:
        self.fd = fd
        self.size = size
        self.own = own
        self.ino = os.fstat(fd).st_ino
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        probe = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(probe)
        del probe
        weakref.finalize(self, os.close, fd)


class Use:
    """Holds one use of a memory; when the last use of a pool segment dies it is free again."""

    __slots__ = ("__weakref__", "memory")

    def __init__(self, memory: Memory) -> None:
        self.memory = memory


class Registry:
    """This process's shared memories, found by address, and what it lent to peers."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.starts: list[int] = []  # sorted base addresses
        self.memories: list[weakref.ref[Memory]] = []
        self.pool: set[Memory] = set()  # our segments, lent or free
        self.free: list[Memory] = []
        self.lent: collections.Counter[int] = collections.Counter()  # ino -> live uses
        self.exports: dict[int, tuple[bytes, list[Any]]] = {}  # id -> (peer, kept alive)
        self.by_peer: dict[bytes, set[int]] = collections.defaultdict(set)
        self.remote: dict[int, weakref.ref[Memory]] = {}  # ino -> a peer's segment mapped here
        self.kept: collections.OrderedDict[int, Memory] = collections.OrderedDict()
        self.ids = itertools.count(1)

    # -- memories -------------------------------------------------------------
    def _add(self, m: Memory) -> None:
        i = bisect.bisect(self.starts, m.base)
        self.starts.insert(i, m.base)
        self.memories.insert(i, weakref.ref(m))
        weakref.finalize(m, self._forget, m.base)

    def _forget(self, base: int) -> None:
        with self.lock:
            i = bisect.bisect_left(self.starts, base)
            if i < len(self.starts) and self.starts[i] == base and self.memories[i]() is None:
                del self.starts[i]
                del self.memories[i]

    def find(self, addr: int, length: int) -> Memory | None:
        """The shared memory that holds ``[addr, addr + length)``, if this process has one."""
        with self.lock:
            i = bisect.bisect(self.starts, addr) - 1
            m = self.memories[i]() if i >= 0 else None
        return m if m is not None and addr + length <= m.base + m.size else None

    def use(self, m: Memory) -> Use:
        u = Use(m)
        with self.lock:
            self.lent[m.ino] += 1
        weakref.finalize(u, self._unused, m)
        return u

    def _unused(self, m: Memory) -> None:
        with self.lock:
            self.lent[m.ino] -= 1
            if self.lent[m.ino] > 0:
                return
            del self.lent[m.ino]
            if m not in self.pool:
                return  # a peer's memory, or a retired segment: it goes with its last reference
            if sum(f.size for f in self.free) + m.size <= _POOL_IDLE_MAX:
                self.free.append(m)
            else:
                self.pool.discard(m)

    def segment(self, nbytes: int) -> Memory:
        """A free pool segment of at least ``nbytes``: a warm one when one fits."""
        with self.lock:
            fits = [m for m in self.free if nbytes <= m.size <= 2 * nbytes + _ROUND]
            if fits:
                best = min(fits, key=lambda m: m.size)
                self.free.remove(best)
                return best
        size = -(-nbytes // _ROUND) * _ROUND
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            m = Memory(fd, size, own=True)
        except OSError as e:
            os.close(fd)
            raise WireError(f"cannot allocate {size} bytes of shared memory: {e}") from None
        with self.lock:
            self.pool.add(m)
            self._add(m)
        return m

    # -- exports --------------------------------------------------------------
    def export(self, peer: bytes, keep: list[Any]) -> int:
        with self.lock:
            eid = next(self.ids)
            self.exports[eid] = (peer, keep)
            self.by_peer[peer].add(eid)
        return eid

    def release(self, peer: bytes, ids: Sequence[int]) -> None:
        """The peer dropped its views of these exports."""
        dropped = []
        with self.lock:
            for eid in ids:
                entry = self.exports.get(eid)
                if entry is not None and entry[0] == peer:
                    dropped.append(self.exports.pop(eid))
                    self.by_peer[peer].discard(eid)
        dropped.clear()  # what they kept alive dies here, outside the lock

    def peer_gone(self, peer: bytes) -> None:
        """The peer may still map what we lent it: retire those segments, never reuse them."""
        with self.lock:
            ids = self.by_peer.pop(peer, set())
            entries = [self.exports.pop(eid) for eid in ids if eid in self.exports]
            for _, keep in entries:
                for obj in keep:
                    if isinstance(obj, Use):
                        self.pool.discard(obj.memory)
        entries.clear()

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's segments are still mapped here, shared with the
        parent, which goes on lending them. The child never reuses, lends or refers to them
        (its sends copy into segments of its own)."""
        self.lock = threading.RLock()
        self.starts, self.memories = [], []
        self.pool, self.free = set(), []
        self.lent = collections.Counter()
        self.exports, self.by_peer = {}, collections.defaultdict(set)

    def statistics(self) -> SharedMemoryStatistics:
        with self.lock:
            return SharedMemoryStatistics(
                segments=len(self.pool),
                segment_bytes=sum(m.size for m in self.pool),
                free_bytes=sum(m.size for m in self.free),
                exports=len(self.exports),
                mapped_remote=sum(1 for r in self.remote.values() if r() is not None),
            )

    # -- peers' memories ------------------------------------------------------
    def open_remote(self, pid: int, fd: int, ino: int, size: int) -> Memory:
        with self.lock:
            ref = self.remote.get(ino)
            m = ref() if ref is not None else None
            if m is not None and m.size == size:
                self.kept[ino] = m
                self.kept.move_to_end(ino)
                return m
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(path).startswith("/memfd:" + MEMFD_NAME):
                raise WireError(f"malformed message: {path} is not an rlferry segment")
            newfd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise WireError(
                f"cannot open the sender's shared memory {path}: {e} (the peer must be a process "
                "of this host and user, in the same pid namespace; else connect over tcp://)"
            ) from None
        try:
            st = os.fstat(newfd)
            if st.st_ino != ino or st.st_size < size:
                raise WireError(f"malformed message: {path} is not the segment announced")
            m = Memory(newfd, size, own=False)
        except BaseException:
            os.close(newfd)
            raise
        with self.lock:
            self.remote[ino] = weakref.ref(m)
            self.kept[ino] = m
            while len(self.kept) > _MAPPINGS_KEPT:
                self.kept.popitem(last=False)
            self._add(m)
        return m


exports = Registry()
"""This process's registry of shared memories and exports."""
os.register_at_fork(after_in_child=exports.forget_after_fork)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def shared_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in a warm shared-memory segment of this process's pool.

    Writing into it costs no page faults once the pool is warm, and sending it
    over ipc:// costs no copy: the peer maps it where it is. The segment goes
    back to the pool when the tensor (and every peer's view of it) is gone.
    Small or non-Linux allocations are plain ``torch.empty``.
    """
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if not AVAILABLE or nbytes < BULK_MIN:
        return torch.empty(tuple(shape), dtype=dtype)
    seg = exports.segment(nbytes)
    holder = (ctypes.c_char * nbytes).from_address(seg.base)
    holder._rlferry_keep = (seg, exports.use(seg))  # type: ignore[attr-defined]
    flat = torch.frombuffer(memoryview(holder).cast("B"), dtype=torch.uint8)
    return flat.view(dtype).reshape(tuple(shape))


def shared_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor in warm shared memory: itself when it lies there already (or is small,
    on another device, or the platform has none), else one copy (contiguous), all the
    copies in one pool segment.

    Sending the results over ipc:// costs no further copy, so a sender can make
    these copies early, while it waits for something else.
    """
    out = list(tensors)
    moves = []
    for i, t in enumerate(out):
        nbytes = t.numel() * t.element_size()
        if not AVAILABLE or nbytes < BULK_MIN or t.device.type != "cpu" or t.is_nested:
            continue
        if t.is_contiguous() and exports.find(t.data_ptr(), nbytes) is not None:
            continue
        moves.append((i, nbytes))
    if not moves:
        return out
    flat = shared_empty([sum(aligned(n) for _, n in moves)], torch.uint8)
    at = 0
    jobs = []
    for i, nbytes in moves:
        t = out[i].detach()
        dst = flat[at : at + nbytes].view(t.dtype).view(t.shape)
        if in_order(t):
            jobs.append((dst.data_ptr(), t.data_ptr(), nbytes))
        else:
            dst.copy_(t)
        out[i] = dst
        at += aligned(nbytes)
    copy_many(jobs)
    return out
