"""Full tensors from FSDP2 shards, gathered a bucket at a time.

``fully_shard`` splits every parameter on dim 0 as ``torch.chunk`` does: rank ``r`` holds
rows ``[r * c, (r + 1) * c)`` of ``n`` with ``c = ceil(n / world)`` (the last ranks fewer,
or none). :func:`gathered` packs the local rows of a bucket's tensors, each padded to
``c`` rows and cast to the push's dtype, into one buffer, gathers it with one
all-gather and cuts the full tensors out of the result: one collective
per bucket instead of one per tensor (``DTensor.full_tensor``), and the full state dict
never exists at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

__all__ = ["BUCKET_BYTES", "gathered"]

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

BUCKET_BYTES = 256 << 20
"""Bytes of full tensors (in the push's dtype) gathered by one collective."""


def gathered(
    model: Any, dtype: torch.dtype, bucket_bytes: int = BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor in dtype)`` of ``model.state_dict()``, in order. A collective:
    every rank must iterate it alike. Tensors that are not row-sharded DTensors (plain
    tensors, other placements) come whole, each by itself."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in model.state_dict().items():
        if not _row_sharded(t):
            yield from _flush(bucket, dtype)
            bucket, size = [], 0
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            yield name, full.to(dtype)
            continue
        bucket.append((name, t))
        size += t.numel() * dtype.itemsize
        if size >= bucket_bytes:
            yield from _flush(bucket, dtype)
            bucket, size = [], 0
    yield from _flush(bucket, dtype)


def _row_sharded(t: Any) -> bool:
    return (
        isinstance(t, DTensor)
        and t.device_mesh.ndim == 1
        and tuple(t.placements) == (Shard(0),)
        and t.dim() > 0
    )


def _flush(bucket: list[tuple[str, Any]], dtype: torch.dtype) -> Iterator[tuple[str, Any]]:
    if not bucket:
        return
    mesh = bucket[0][1].device_mesh
    world = mesh.size()
    parts = []  # per tensor: rows per rank (c), elements per row, offset in a rank's part
    offset = 0
    for _, t in bucket:
        rows = -(-t.shape[0] // world)
        per_row = math.prod(t.shape[1:])
        parts.append((rows, per_row, offset))
        offset += rows * per_row
    local = bucket[0][1].to_local()
    send = torch.zeros(offset, dtype=dtype, device=local.device)
    for (_, t), (_rows, _per_row, at) in zip(bucket, parts, strict=True):
        mine = t.to_local().reshape(-1)
        send[at : at + mine.numel()].copy_(mine)  # the padding rows stay 0
    out = torch.empty(world * offset, dtype=dtype, device=local.device)
    _all_gather(out, send, group=mesh.get_group())
    ranks = out.view(world, offset)
    for (name, t), (rows, per_row, at) in zip(bucket, parts, strict=True):
        padded = ranks[:, at : at + rows * per_row].reshape(world * rows, *t.shape[1:])
        yield name, padded[: t.shape[0]]
