"""Fetch on one rank, broadcast to the others of a ``torch.distributed`` group (no pickle)."""

from __future__ import annotations

from typing import Any

import torch

from rlferry.errors import RequestError
from rlferry.wire import decode, encode
from rlferry.wire.lowlevel import tensor_buffer

from ._client import Batch
from ._sync_client import QueueClient

__all__ = ["get_broadcast"]


def get_broadcast(
    client: QueueClient | None,
    partition: str,
    *,
    src: int = 0,
    group: Any = None,
    **get: Any,
) -> Batch:
    """Rank ``src`` gets a batch from the queue; every rank of ``group`` returns the same batch.

    Use it where TP/PP peers should not each ask the queue (one request instead
    of one per peer). The batch travels as the wire codec's frames in two
    broadcasts (sizes, then bytes), on CUDA tensors for NCCL groups: nothing is
    pickled. ``client`` may be None on the other ranks; ``get`` takes the
    arguments of :meth:`QueueClient.get`.
    """
    import torch.distributed as dist

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if (dist.get_backend(group) == "nccl")
        else torch.device("cpu")
    )
    if dist.get_rank() == src:
        if client is None:
            raise RequestError(f"client: expected a QueueClient on the source rank {src}, got None")
        b = client.get(partition, **get)
        frames = [
            memoryview(f).cast("B")
            for f in encode(
                [b.partition, b.task, b.indexes, b.data, b.meta, b.partition_meta, b.lease]
            )
        ]
        sizes = torch.tensor([len(frames), *(f.nbytes for f in frames)], dtype=torch.int64)
        count = torch.tensor([sizes.numel()], dtype=torch.int64, device=device)
        dist.broadcast(count, src, group=group)
        dist.broadcast(sizes.to(device), src, group=group)
        payload = torch.empty(int(sizes[1:].sum()), dtype=torch.uint8)
        at = 0
        for f in frames:
            payload[at : at + f.nbytes] = torch.frombuffer(f, dtype=torch.uint8) if f.nbytes else 0
            at += f.nbytes
        dist.broadcast(payload.to(device), src, group=group)
        return b
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(count, src, group=group)
    sizes = torch.zeros(int(count.item()), dtype=torch.int64, device=device)
    dist.broadcast(sizes, src, group=group)
    lengths = sizes.cpu().tolist()[1:]
    payload = torch.empty(sum(lengths), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src, group=group)
    host = payload.cpu()
    view = tensor_buffer(host)
    frames, at = [], 0
    for n in lengths:
        frames.append(view[at : at + n])
        at += n
    partition_, task, indexes, data, meta, pmeta, lease = decode(frames)
    return Batch(partition_, task, indexes, data, meta, pmeta, lease)
