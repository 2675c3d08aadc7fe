"""The bucket plan: where every tensor of a push lies in the bucket stream.

A plan is built by the sender from the names, shapes and dtypes of the pushed
tensors (no data) and a bucket size. Tensors are laid out in order, each at a
256-byte aligned offset of its bucket; a tensor that does not fit the rest of
a bucket starts the next one, and a tensor larger than a bucket is split into
pieces over consecutive buckets (the receiver joins them before ``load``).
Receivers get the plan once and validate it before any bucket moves; later
pushes with the same layout only say "bucket k is ready".
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._errors import WeightSyncError
from ._specs import TensorSpec, dtype_from_name, dtype_name

__all__ = ["ALIGN", "RAMP_BYTES", "Chunk", "Plan", "default_bucket_bytes"]

ALIGN = 256
# The first and last buckets of a stream whose transfer follows a pack and precedes a load
# (NCCL on a GPU), where buckets are of 16 times this or more (see Plan.build)
RAMP_BYTES = 32 << 20


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _ramp_order(specs: Sequence[TensorSpec], bucket_bytes: int, ramp: int) -> list[int]:
    """The order a ramped plan lays tensors out in: tensors of at most ``ramp`` bytes
    fill the rising ramp (from the front) and the falling one (from the back), up to
    ``bucket_bytes`` or half of all such tensors each; every other tensor keeps its place
    between them."""
    small = [i for i, s in enumerate(specs) if _aligned(s.nbytes) <= ramp]
    each = min(bucket_bytes, sum(_aligned(specs[i].nbytes) for i in small) // 2)

    def pick(indices: Iterable[int]) -> list[int]:
        out, room = [], each
        for i in indices:
            room -= _aligned(specs[i].nbytes)
            if room < 0:
                break
            out.append(i)
        return out

    head = pick(small)
    tail = pick(reversed(small[len(head) :]))[::-1]
    taken = {*head, *tail}
    return head + [i for i in range(len(specs)) if i not in taken] + tail


class Chunk(NamedTuple):
    """Bytes ``[start, start + length)`` of tensor ``tensor``, at ``offset`` of ``bucket``."""

    tensor: int
    start: int
    length: int
    bucket: int
    offset: int


@dataclass(frozen=True)
class Plan:
    """The layout of one push: tensor specs, their chunks in order, the buckets' used bytes."""

    specs: tuple[TensorSpec, ...]
    chunks: tuple[Chunk, ...]
    bucket_used: tuple[int, ...]  # bytes of each bucket up to its last chunk's end, aligned
    bucket_bytes: int
    fingerprint: str

    @classmethod
    def build(cls, specs: Iterable[TensorSpec], bucket_bytes: int, ramp: int = 0) -> Plan:
        """Lay ``specs`` out in buckets of at most ``bucket_bytes``.

        ``ramp`` (a multiple of ALIGN; 0: off): the first bucket holds at most ``ramp``
        bytes and each next one twice the last, up to ``bucket_bytes``; near the end each
        bucket takes half of what is left, down to ``ramp``. A pipeline of pack, send and
        load waits for the first bucket's pack and the last one's load alone, so small
        ones at both ends shorten it. With a ramp, tensors that fit the smallest bucket
        whole fill the ramps (the first ones from the front, the last from the back) and
        the others keep their order between them: the ends are not split, and a large
        tensor's load does not end the stream. No ramp for buckets under 16 ``ramp`` or a
        push of at most 4: each more bucket costs a collective's fixed time (one rank to
        one over NVLink, 4.1 GB in buckets of 297 MiB: 14.0 ms ramped, 13.6 not; 16.4 GB
        in buckets of 1187 MiB: 51.7 ramped, 53.0 not; ``python
        benchmarks/weights_sharded.py --device cuda --transport broadcast --point-to-point
        --senders 1 --receivers 1 --scale 2|1`` on four H100s)."""
        specs = tuple(specs)
        if not specs:
            raise WeightSyncError("push: expected at least one named tensor, got none")
        if bucket_bytes <= 0 or bucket_bytes % ALIGN:
            raise WeightSyncError(
                f"bucket_bytes: expected a positive multiple of {ALIGN}, got {bucket_bytes}"
            )
        if ramp < 0 or ramp % ALIGN:
            raise WeightSyncError(f"ramp: expected 0 or a positive multiple of {ALIGN}, got {ramp}")
        seen: set[str] = set()
        for s in specs:
            if s.name in seen:
                raise WeightSyncError(
                    f"tensor `{s.name}` is pushed twice (every name of one push must be unique)"
                )
            seen.add(s.name)
        rest = sum(s.nbytes for s in specs)
        ramp = ramp if 16 * ramp <= bucket_bytes and rest > 4 * ramp else 0
        order = _ramp_order(specs, bucket_bytes, ramp) if ramp else range(len(specs))

        def cap(k: int) -> int:  # bucket k's size, fixed when it starts with ``rest`` to go
            if not ramp:
                return bucket_bytes
            up = ramp << k if k < 62 else bucket_bytes
            down = _aligned(rest) if rest <= 2 * ramp else rest // 2 // ALIGN * ALIGN
            return min(bucket_bytes, up, down)

        chunks: list[Chunk] = []
        used: list[int] = [0]
        room = cap(0)
        for i in order:
            n = specs[i].nbytes
            at = used[-1]
            if at > 0 and at + n > room:
                if ramp and 2 * at < room and at + n <= min(2 * room, bucket_bytes):
                    room = at + n  # a ramp's bucket under half full grows to take it whole
                elif n <= bucket_bytes or at >= room:
                    used.append(0)  # it fits a bucket of its own (or this one is full): the next
                    at, room = 0, cap(len(used) - 1)
            if at == 0 and room < n <= bucket_bytes:
                room = n  # a ramp's bucket grows to hold a tensor whole rather than split it
            start = 0
            while True:
                length = min(n - start, room - at)
                chunks.append(Chunk(i, start, length, len(used) - 1, at))
                used[-1] = _aligned(at + length)
                start += length
                rest -= length
                if start >= n:
                    break
                used.append(0)
                at, room = 0, cap(len(used) - 1)
        h = hashlib.sha256(f"{bucket_bytes}/{ramp}".encode())
        for s in specs:
            h.update(f"\0{s.name}\0{s.shape}\0{s.dtype}".encode())
        return cls(specs, tuple(chunks), tuple(used), bucket_bytes, h.hexdigest()[:16])

    @property
    def buckets(self) -> int:
        return len(self.bucket_used)

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @functools.cached_property
    def order(self) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """Per bucket: the tensors with a chunk in it, the last of them, and the
        tensors whose last chunk it holds (done with once it is packed)."""
        tensors: list[list[int]] = [[] for _ in self.bucket_used]
        done: list[list[int]] = [[] for _ in self.bucket_used]
        last_bucket: dict[int, int] = {}
        for c in self.chunks:
            tensors[c.bucket].append(c.tensor)
            last_bucket[c.tensor] = c.bucket
        for t, b in last_bucket.items():
            done[b].append(t)
        return tensors, [max(ts) for ts in tensors], done

    @property
    def buffer_bytes(self) -> int:
        """The size a bucket buffer needs: the largest bucket."""
        return max(self.bucket_used, default=0) or ALIGN

    def by_bucket(self) -> list[list[Chunk]]:
        out: list[list[Chunk]] = [[] for _ in self.bucket_used]
        for c in self.chunks:
            out[c.bucket].append(c)
        return out

    def split(self) -> set[int]:
        """Indices of the tensors that lie in more than one chunk."""
        return {c.tensor for c in self.chunks if c.start > 0}

    # -- on the wire -----------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        flat: list[int] = []
        for c in self.chunks:
            flat += c
        return {
            "names": [s.name for s in self.specs],
            "shapes": [list(s.shape) for s in self.specs],
            "dtypes": [dtype_name(s.dtype) for s in self.specs],
            "chunks": flat,
            "used": list(self.bucket_used),
            "bucket_bytes": self.bucket_bytes,
            "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Plan:
        try:
            names, shapes, dtypes = d["names"], d["shapes"], d["dtypes"]
            if not (len(names) == len(shapes) == len(dtypes)):
                raise ValueError
            specs = tuple(
                TensorSpec(str(n), tuple(int(x) for x in sh), dtype_from_name(dt))
                for n, sh, dt in zip(names, shapes, dtypes, strict=True)
            )
            flat = [int(x) for x in d["chunks"]]
            chunks = tuple(Chunk(*flat[i : i + 5]) for i in range(0, len(flat), 5))
            used = tuple(int(x) for x in d["used"])
            plan = cls(specs, chunks, used, int(d["bucket_bytes"]), str(d["fingerprint"]))
        except (KeyError, TypeError, ValueError):
            raise WeightSyncError("malformed plan") from None
        for c in chunks:
            if not (
                0 <= c.tensor < len(specs)
                and 0 <= c.bucket < len(used)
                and c.start >= 0
                and c.length >= 0
                and c.start + c.length <= specs[c.tensor].nbytes
                and c.offset % ALIGN == 0
                and c.offset + c.length <= used[c.bucket]
            ):
                raise WeightSyncError(f"malformed plan: chunk {tuple(c)} out of range")
        return plan


_MiB = 1 << 20


def default_bucket_bytes(device: torch.device, largest: int) -> int:
    """Half of what the two buffers may take: 1/16 of free device memory within
    [64 MiB, 256 MiB], raised to the largest tensor when that fits in 1/8 (no split);
    on the CPU (shm) 64 MiB, where more buckets pipeline better, raised to the
    largest tensor up to 1 GiB (a split tensor costs the receiver one more copy,
    into the staging tensor that joins its pieces). On CUDA the cap is 256 MiB, not
    more: a smaller first bucket starts the link sooner and a smaller last one ends it
    sooner (2 trainer ranks to a TP=2 engine, 4.1 GB, 11.4 ms a push with 256 MiB
    buckets against 13.3 ms with 1 GiB, measured by ``python benchmarks/weights_sharded.py
    --device cuda --transport broadcast --point-to-point --senders 2 --receivers 2
    --scale 2 --bucket-mb 1024`` on four H200s)."""
    if device.type != "cuda":
        bucket = largest if 64 * _MiB < largest <= 1024 * _MiB else 64 * _MiB
        return -(-bucket // 256) * 256
    free = torch.cuda.mem_get_info(device)[0]
    bucket = min(256 * _MiB, max(64 * _MiB, free // 16))
    if bucket < largest <= free // 8:
        bucket = largest
    return -(-bucket // 256) * 256
