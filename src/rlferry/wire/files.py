"""Values written to a file and read back without running code (stand-in, replaced)."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from ._codec import encode
from ._decode import decode

__all__ = ["read_file", "write_file"]


def write_file(path: str | os.PathLike[str], value: Any) -> int:
    path = Path(path)
    frames = [memoryview(f).cast("B") for f in encode(value)]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(frames)))
        f.write(struct.pack(f"<{len(frames)}Q", *(m.nbytes for m in frames)))
        for m in frames:
            f.write(m)
    os.replace(tmp, path)
    return path.stat().st_size


def read_file(path: str | os.PathLike[str]) -> Any:
    data = bytearray(Path(path).read_bytes())
    view = memoryview(data)
    (count,) = struct.unpack_from("<Q", view, 0)
    sizes = struct.unpack_from(f"<{count}Q", view, 8)
    at = 8 + 8 * count
    frames = []
    for n in sizes:
        frames.append(view[at : at + n])
        at += n
    return decode(frames)
