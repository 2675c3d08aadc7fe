"""A message's bulk frames through shared memory: moved by the sender, mapped by the receiver.

Over ipc:// a frame of :data:`~._shm.BULK_MIN` bytes or more does not go through the
socket. :func:`pack_bulk` copies it into a pool segment (see ``_shm.py``) or, when
it already lies in shared memory this process holds, refers to it where it is; the
message carries the segments' coordinates in a *bulk descriptor*. :func:`unpack_bulk`
maps them on the other side and hands out views (:class:`BulkFrame`); when the last
view dies, the receiver owes the sender a release of that export.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Callable
from typing import Any

import msgspec

from .._errors import WireError
from .._refs import address_of
from ._copies import copy_many
from ._segments import BULK_MIN, Memory, Use, aligned, exports

__all__ = ["BulkFrame", "pack_bulk", "unpack_bulk"]

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
    used: dict[int, Use] = {}
    entries: list[list[int]] = []
    to_copy: list[tuple[int, memoryview]] = []
    for i in range(len(frames)):  # a large header (long strings) goes too
        view = memoryview(getattr(frames[i], "buffer", frames[i])).cast("B")
        if view.nbytes < BULK_MIN:
            continue
        out[i] = b""
        mem = None if view.readonly else exports.find(address_of(view), view.nbytes)
        if mem is None:
            to_copy.append((i, view))
            continue
        if mem.ino not in used:  # one use per memory, however many frames lie in it
            used[mem.ino] = exports.use(mem)
        keep.append(frames[i])  # the frame's owner stays alive while lent
        entries.append([i, mem.fd, mem.ino, mem.size, address_of(view) - mem.base, view.nbytes])
    keep += used.values()
    if not entries and not to_copy:
        return b"", frames
    if to_copy:
        seg = exports.segment(sum(aligned(v.nbytes) for _, v in to_copy))
        keep.append(exports.use(seg))
        at = 0
        for i, view in to_copy:
            _copy(seg, at, view)
            entries.append([i, seg.fd, seg.ino, seg.size, at, view.nbytes])
            at += aligned(view.nbytes)
    eid = exports.export(peer, keep)
    return _enc.encode([eid, os.getpid(), entries]), out


def _copy(seg: Memory, at: int, view: memoryview) -> None:
    """One copy into the segment, shared among threads when it is large."""
    if view.readonly:
        seg.mm[at : at + view.nbytes] = view
    else:
        copy_many([(seg.base + at, address_of(view), view.nbytes)])


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
