"""Bulk frames between processes of one host through shared memory, copied at most once.

Over ipc:// a large frame does not go through the socket. The sender copies it
into a *segment* (a memfd from its pool, mapped and kept warm) or, when the
frame already lies in shared memory this process holds (a frame it received),
refers to it where it is: no copy at all. The message carries only the
segment's coordinates; the receiver maps the segment (once, then cached) and
decodes tensors as views of it.

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
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch

from ._copy import copy_many, in_order
from ._errors import WireError

__all__ = [
    "AVAILABLE",
    "BULK_MIN",
    "BulkFrame",
    "exports",
    "pack_bulk",
    "shared_copies",
    "shared_empty",
    "unpack_bulk",
]

AVAILABLE = hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")
BULK_MIN = 64 * 1024  # smaller frames are cheaper through the socket
_ALIGN = 256
_ROUND = 2 << 20
_MEMFD_NAME = "rlferry-bulk"
_POOL_IDLE_MAX = 4 << 30  # free segment bytes kept warm for reuse
_MAPPINGS_KEPT = 8  # remote segments kept mapped after their last view died


def _address(buf: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class _Memory:
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


class _Use:
    """Holds one use of a memory; when the last use of a pool segment dies it is free again."""

    __slots__ = ("__weakref__", "memory")

    def __init__(self, memory: _Memory) -> None:
        self.memory = memory


class _Registry:
    """This process's shared memories, found by address, and what it lent to peers."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.starts: list[int] = []  # sorted base addresses
        self.memories: list[weakref.ref[_Memory]] = []
        self.pool: set[_Memory] = set()  # our segments, lent or free
        self.free: list[_Memory] = []
        self.lent: collections.Counter[int] = collections.Counter()  # ino -> live uses
        self.exports: dict[int, tuple[bytes, list[Any]]] = {}  # id -> (peer, kept alive)
        self.by_peer: dict[bytes, set[int]] = collections.defaultdict(set)
        self.remote: dict[int, weakref.ref[_Memory]] = {}  # ino -> a peer's segment mapped here
        self.kept: collections.OrderedDict[int, _Memory] = collections.OrderedDict()
        self.ids = itertools.count(1)

    # -- memories -------------------------------------------------------------
    def _add(self, m: _Memory) -> None:
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

    def find(self, addr: int, length: int) -> _Memory | None:
        """The shared memory that holds ``[addr, addr + length)``, if this process has one."""
        with self.lock:
            i = bisect.bisect(self.starts, addr) - 1
            m = self.memories[i]() if i >= 0 else None
        return m if m is not None and addr + length <= m.base + m.size else None

    def use(self, m: _Memory) -> _Use:
        u = _Use(m)
        with self.lock:
            self.lent[m.ino] += 1
        weakref.finalize(u, self._unused, m)
        return u

    def _unused(self, m: _Memory) -> None:
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

    def segment(self, nbytes: int) -> _Memory:
        """A free pool segment of at least ``nbytes``: a warm one when one fits."""
        with self.lock:
            fits = [m for m in self.free if nbytes <= m.size <= 2 * nbytes + _ROUND]
            if fits:
                best = min(fits, key=lambda m: m.size)
                self.free.remove(best)
                return best
        size = -(-nbytes // _ROUND) * _ROUND
        fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            m = _Memory(fd, size, own=True)
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
                    if isinstance(obj, _Use):
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

    def statistics(self) -> dict[str, int]:
        with self.lock:
            return {
                "segments": len(self.pool),
                "segment_bytes": sum(m.size for m in self.pool),
                "free_bytes": sum(m.size for m in self.free),
                "exports": len(self.exports),
                "mapped_remote": sum(1 for r in self.remote.values() if r() is not None),
            }

    # -- peers' memories ------------------------------------------------------
    def open_remote(self, pid: int, fd: int, ino: int, size: int) -> _Memory:
        with self.lock:
            ref = self.remote.get(ino)
            m = ref() if ref is not None else None
            if m is not None and m.size == size:
                self.kept[ino] = m
                self.kept.move_to_end(ino)
                return m
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(path).startswith("/memfd:" + _MEMFD_NAME):
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
            m = _Memory(newfd, size, own=False)
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


exports = _Registry()
os.register_at_fork(after_in_child=exports.forget_after_fork)
_enc = msgspec.msgpack.Encoder()


def pack_bulk(frames: list[Any], peer: bytes) -> tuple[bytes, list[Any]]:
    """Move the large frames of a message (the header too, if it is large) to shared memory.

    A frame that already lies in shared memory this process holds is referred
    to where it is; the others are copied, once, into one pool segment.
    Returns the bulk descriptor (b"" when nothing moved) and the frames with
    the moved ones replaced by empty placeholders.
    """
    out = list(frames)
    keep: list[Any] = []
    used: dict[int, _Use] = {}
    entries: list[list[int]] = []
    to_copy: list[tuple[int, memoryview]] = []
    for i in range(len(frames)):  # a large header (long strings) goes too
        view = memoryview(getattr(frames[i], "buffer", frames[i])).cast("B")
        if view.nbytes < BULK_MIN:
            continue
        out[i] = b""
        mem = None if view.readonly else exports.find(_address(view), view.nbytes)
        if mem is None:
            to_copy.append((i, view))
            continue
        if mem.ino not in used:  # one use per memory, however many frames lie in it
            used[mem.ino] = exports.use(mem)
        keep.append(frames[i])  # the frame's owner stays alive while lent
        entries.append([i, mem.fd, mem.ino, mem.size, _address(view) - mem.base, view.nbytes])
    keep += used.values()
    if not entries and not to_copy:
        return b"", frames
    if to_copy:
        seg = exports.segment(sum(_aligned(v.nbytes) for _, v in to_copy))
        keep.append(exports.use(seg))
        at = 0
        for i, view in to_copy:
            _copy(seg, at, view)
            entries.append([i, seg.fd, seg.ino, seg.size, at, view.nbytes])
            at += _aligned(view.nbytes)
    eid = exports.export(peer, keep)
    return _enc.encode([eid, os.getpid(), entries]), out


def _copy(seg: _Memory, at: int, view: memoryview) -> None:
    """One copy into the segment, shared among threads when it is large."""
    if view.readonly:
        seg.mm[at : at + view.nbytes] = view
    else:
        copy_many([(seg.base + at, _address(view), view.nbytes)])


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class BulkFrame:
    """A received frame that lies in a peer's shared memory: ``buffer`` holds its bytes,
    at ``offset`` in ``whole`` (the view of the segment, shared by every frame of one
    message that lies in it), so a decoder can cut many tensors from one base."""

    __slots__ = ("buffer", "offset", "whole")

    def __init__(self, whole: memoryview, offset: int, length: int) -> None:
        self.whole = whole
        self.offset = offset
        self.buffer = whole[offset : offset + length]


class _Lease:
    """One received message's hold on the sender's memory; when it dies, the release is sent."""

    __slots__ = ("__weakref__",)


def unpack_bulk(
    desc: bytes, frames: list[Any], peer_pid: int | None, on_release: Callable[[int], None]
) -> list[Any]:
    """Put views of the sender's shared memory (:class:`BulkFrame`) in place of the
    placeholder frames.

    ``on_release(export_id)`` is called (from whichever thread frees the last
    view) once no view of this message's shared memory is left.
    """
    try:
        eid, pid, entries = msgspec.msgpack.decode(desc)
        if not (type(eid) is int and type(pid) is int and isinstance(entries, list)):
            raise TypeError
    except (msgspec.DecodeError, ValueError, TypeError):
        raise WireError("malformed message: bad shared-memory descriptor") from None
    lease = _Lease()
    weakref.finalize(lease, on_release, eid)  # also when this message turns out malformed
    if peer_pid is not None and pid != peer_pid:
        raise WireError(f"malformed message: shared memory of pid {pid} sent by pid {peer_pid}")
    out = list(frames)
    whole: dict[int, memoryview] = {}  # one view per memory, sliced per frame
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 6 and all(type(x) is int for x in entry)):
            raise WireError("malformed message: bad shared-memory entry")
        index, fd, ino, size, offset, length = entry
        if not (0 <= index < len(out)) or offset < 0 or length < 0 or offset + length > size:
            raise WireError("malformed message: shared-memory entry out of range")
        view = whole.get(ino)
        if view is None or view.nbytes != size:
            mem = exports.open_remote(pid, fd, ino, size)
            holder = (ctypes.c_char * size).from_address(mem.base)
            holder._rlferry_keep = (mem, lease)
            view = whole[ino] = memoryview(holder).cast("B")
        out[index] = BulkFrame(view, offset, length)
    return out


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
    flat = shared_empty([sum(_aligned(n) for _, n in moves)], torch.uint8)
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
        at += _aligned(nbytes)
    copy_many(jobs)
    return out
