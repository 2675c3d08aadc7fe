"""Checkpoint files that run no code when read: the wire's frames, sized, checksummed, whole.

A file is one value in the wire's forms (:func:`rlferry.wire.encode`: a msgpack header and
one raw frame per tensor or array, never a pickle)::

    magic     8 bytes   b"\\x89RLF\\r\\n\\x1a\\n"
    version   u32       FORMAT_VERSION
    reserved  u32       0
    count     u64       the number of frames
    sizes     u64 each  the frames' sizes in bytes
    frames              the frames, back to back
    digest    32 bytes  sha256 of the sha256 of each piece of the above, in order

(integers little-endian; the pieces are the fixed part with the sizes, then each frame cut
into pieces of ``PIECE`` bytes: their digests are computed on all cores at once).
:func:`write_file` writes it under a temporary name in the same
directory, fsyncs it, renames it into place and fsyncs the directory, so that the path
holds the old file or the new one, whole, whatever moment the writer dies. :func:`read_file`
checks the magic, the version, the length and the checksum before it decodes anything.

A checkpoint made of several files is a directory: :func:`new_directory` gives a fresh
``DIR.tmp-<random>`` to write them into and renames it to ``DIR`` once it is whole (the
older ``DIR`` renamed to ``DIR.old`` first, removed after); :func:`whole_directory` is where
a reader finds the last whole one (``DIR``, or ``DIR.old`` when a writer died between its
two renames).

The digests are computed on other threads while the frames are written:
``python benchmarks/checkpoint_files.py`` measures the checked write and read against a raw
write of the same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ._codec import encode
from ._decode import decode
from ._errors import FileFormatError, WireError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "PIECE",
    "FileFormatError",
    "fsync_directory",
    "new_directory",
    "read_file",
    "whole_directory",
    "write_file",
]

MAGIC = b"\x89RLF\r\n\x1a\n"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sIIQ")  # magic, version, reserved, count
_SIZE = struct.Struct("<Q")
_DIGEST = 32  # sha256
PIECE = 16 << 20  # bytes hashed by one thread at a time
_THREADS = min(16, os.cpu_count() or 1)

# What a foreign file starts with, and what it is then: named in the refusal.
_FOREIGN = (
    (b"PK\x03\x04", "a torch.save archive (a zip file)"),
    (b"\x80", "a pickle"),
    (b"\x93NUMPY", "a numpy .npy file"),
)

StrPath = str | os.PathLike[str]


def _pieces(head: memoryview, frames: list[memoryview]) -> list[memoryview]:
    out = [head]
    for m in frames:
        out.extend(m[at : at + PIECE] for at in range(0, m.nbytes, PIECE))
    return out


def _digest(pool: ThreadPoolExecutor, head: memoryview, frames: list[memoryview]) -> bytes:
    """The file's digest: sha256 of the pieces' sha256s (hashlib lets go of the GIL, so the
    pieces are hashed on all of ``pool``'s threads at once)."""
    parts = pool.map(lambda m: hashlib.sha256(m).digest(), _pieces(head, frames))
    return hashlib.sha256(b"".join(parts)).digest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_directory(path: StrPath) -> None:
    """Flush a directory's entries (a rename or a new file in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: StrPath, value: Any) -> int:
    """Write ``value`` to the file ``path`` in rlferry's checked format; return its size.

    ``value`` is anything :func:`rlferry.wire.encode` takes: dicts with str keys, lists,
    tuples, str, bytes, int, float, bool, None, numpy arrays and torch tensors of every
    dtype (bfloat16 and float8 too; a CUDA tensor is copied to the host and comes back on
    the CPU). The file is written as ``<path>.tmp-<random>``, fsynced and renamed to
    ``path``: a reader finds the previous file or this one, never a part.

    Raises:
        WireError: a value the wire does not carry, naming its path (``$.state[3]``).
        OSError: the file could not be written (``path`` is left as it was).
    """
    target = Path(path)
    frames = [memoryview(f).cast("B") for f in encode(value)]
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(frames)) + b"".join(
        _SIZE.pack(m.nbytes) for m in frames
    )
    tmp = target.with_name(f"{target.name}.tmp-{secrets.token_hex(4)}")
    try:
        with (
            open(tmp, "wb") as f,
            ThreadPoolExecutor(_THREADS) as pool,
            ThreadPoolExecutor(1) as driver,
        ):
            digest = driver.submit(_digest, pool, memoryview(head), frames)  # while written
            f.write(head)
            for m in frames:
                f.write(m)
            f.write(digest.result())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)
    return len(head) + sum(m.nbytes for m in frames) + _DIGEST


def _refuse(path: Path, what: str) -> FileFormatError:
    return FileFormatError(f"{path}: {what}")


def _foreign(path: Path, start: bytes) -> FileFormatError:
    for prefix, name in _FOREIGN:
        if start.startswith(prefix):
            return FileFormatError(
                f"{path}: not an rlferry file: it starts like {name}, which rlferry does "
                "not read (loading it can run code); write it with rlferry.wire.files."
                "write_file",
                looks_like=name,
            )
    return _refuse(
        path,
        f"not an rlferry file: it starts with {start[:8]!r}, expected {MAGIC!r} "
        "(a file written by rlferry.wire.files.write_file)",
    )


def read_file(path: StrPath) -> Any:
    """The value :func:`write_file` wrote to ``path``; tensors and arrays are views of one
    buffer read from the file (writable, on the CPU). Nothing is unpickled.

    Raises:
        FileFormatError: naming the file and what is wrong: not this format (and what it
            looks like: a pickle, a torch.save archive), a newer format version, truncated
            (expected N bytes, got M), or a checksum mismatch (changed or corrupted).
        FileNotFoundError: no file at ``path``.
    """
    source = Path(path)
    with open(source, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = f.read(_FIXED.size)
        if not MAGIC.startswith(start[:8]) or (len(start) >= 8 and start[:8] != MAGIC):
            raise _foreign(source, start)
        if len(start) < _FIXED.size:
            raise _refuse(
                source,
                f"truncated: expected at least {_FIXED.size} bytes, got {size} "
                "(the write did not finish, or the file was cut)",
            )
        _, version, _, count = _FIXED.unpack(start)
        if version > FORMAT_VERSION:
            raise _refuse(
                source,
                f"format version {version}, this rlferry reads versions up to "
                f"{FORMAT_VERSION} (read it with the newer rlferry that wrote it)",
            )
        if _FIXED.size + _SIZE.size * count + _DIGEST > size:
            raise _refuse(
                source,
                f"truncated: expected at least {_FIXED.size + _SIZE.size * count + _DIGEST} "
                f"bytes for {count} frames, got {size} (the write did not finish, or the "
                "file was cut)",
            )
        f.seek(0)
        data = bytearray(size)
        view = memoryview(data)
        got = 0
        while got < size and (n := f.readinto(view[got:])):
            got += n
    sizes = struct.unpack_from(f"<{count}Q", view, _FIXED.size)
    at = _FIXED.size + _SIZE.size * count
    expected = at + sum(sizes) + _DIGEST
    if expected != size or got != size:
        what = "truncated" if expected > min(size, got) else "longer than written"
        raise _refuse(
            source,
            f"{what}: expected {expected} bytes, got {min(size, got)} (the write did not "
            "finish, or the file was cut or changed)",
        )
    frames = []
    for n in sizes:
        frames.append(view[at : at + n])
        at += n
    with ThreadPoolExecutor(_THREADS) as pool:
        digest = _digest(pool, view[: _FIXED.size + _SIZE.size * count], frames)
    if digest != bytes(view[size - _DIGEST :]):
        raise _refuse(
            source,
            "checksum mismatch: the bytes are not those written (the file was changed "
            "or corrupted; use another checkpoint)",
        )
    try:
        return decode(frames)
    except WireError as e:
        raise _refuse(source, str(e)) from None


def _replaceable(target: Path, marker: str) -> bool:
    if not target.exists():
        return True
    return target.is_dir() and ((target / marker).exists() or next(target.iterdir(), None) is None)


@contextlib.contextmanager
def new_directory(path: StrPath, *, replaces: str | None = None) -> Iterator[Path]:
    """A fresh directory to write a checkpoint of several files into; ``path`` once whole.

    Yields ``<path>.tmp-<random>`` (its parents made). When the ``with`` block ends without
    an exception, its files and itself are fsynced and it is renamed to ``path``: an older
    ``path`` is renamed to ``<path>.old`` first and removed after, and older
    ``<path>.tmp-*`` directories (left by writers that died) are removed. When the block
    raises, the temporary directory is removed and ``path`` is untouched. One writer per
    ``path`` at a time.

    ``replaces``: the name of a file that an existing ``path`` must hold to be replaced (an
    empty directory is replaced too), so that a directory of other files is never removed.

    Raises:
        FileExistsError: ``path`` exists and is not a checkpoint ``replaces`` names (nothing
            is written).
    """
    target = Path(path)
    if replaces is not None and not _replaceable(target, replaces):
        raise FileExistsError(
            f"{target}: expected a checkpoint to replace (holding {replaces}), an empty "
            "directory or a new path, got other files (write the checkpoint to a new path)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_dir():
                fsync_directory(p)
            else:
                _fsync_file(p)
        fsync_directory(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = target.with_name(f"{target.name}.old")
    if target.exists():
        if old.exists():
            shutil.rmtree(old)
        target.rename(old)
    tmp.rename(target)
    fsync_directory(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    for stale in target.parent.glob(f"{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def whole_directory(path: StrPath) -> Path:
    """Where the last whole checkpoint :func:`new_directory` wrote to ``path`` is: ``path``,
    or ``<path>.old`` when a writer died between its two renames.

    Raises:
        FileNotFoundError: neither exists (naming ``path``).
    """
    target = Path(path)
    if target.is_dir():
        return target
    old = target.with_name(f"{target.name}.old")
    if old.is_dir():
        return old
    raise FileNotFoundError(f"Checkpoint directory not found: {target}")
