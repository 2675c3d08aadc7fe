"""How an :class:`~rlferry.engines.hf.HFEngine` joins the trainer's senders of a group: one
``WeightReceiver`` for a ``WeightSender``, one ``ShardedReceiver`` for ``ShardedSender``
ranks (each trainer rank sending its own shards)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import torch

from rlferry.weights import ParamLoader, ShardedReceiver, WeightReceiver, describe_group
from rlferry.weights.planning import EngineLayout

from ._lora import ServedAdapter

__all__ = ["join_senders"]

Load = Callable[
    [Callable[[list[tuple[str, torch.Tensor]]], Any], list[tuple[str, torch.Tensor]]], None
]
"""The engine's load: ``load(loader, items)`` gates the engine's steps around ``loader``."""


async def join_senders(
    group: str,
    address: str,
    *,
    tensors: dict[str, torch.Tensor],
    name: str,
    device: torch.device | None,
    secret: str | bytes | None,
    timeout: float,
    load: Load,
    on_commit: Callable[[int], None],
    adapter: ServedAdapter | None = None,
) -> WeightReceiver | ShardedReceiver:
    """A started receiver of ``group`` at ``address`` that loads into ``tensors`` (the
    engine's, by their state_dict names) through ``load`` and calls ``on_commit(version)``
    once a version committed whole.

    ``address`` is asked who sends ``group`` first: a ``WeightSender`` on its own is joined
    by one ``WeightReceiver`` (checking every plan against ``tensors``; a delta push is
    applied to ``tensors`` in place); the rank 0 of
    ``ShardedSender`` ranks describes every rank and the trainer layout, and a
    ``ShardedReceiver`` joins every rank, ``tensors`` whole (``EngineLayout.whole`` in
    their dtypes). Point to point, ``address`` is rank 0's link to this engine's rank: it
    learns its rank and joins every rank's link to it. ``adapter``: the engine's LoRA
    adapter slots, whose check replaces ``tensors``' (adapters come from a
    ``WeightSender``: ranks whose layout holds one are refused here)."""
    found = await asyncio.to_thread(describe_group, group, address, secret=secret, timeout=timeout)
    recv: WeightReceiver | ShardedReceiver
    if found.trainer is None or found.addresses is None:
        recv = WeightReceiver(
            group=group, address=address, load=functools.partial(load, ParamLoader(tensors)),
            on_commit=on_commit, expected=adapter.check(tensors) if adapter else tensors,
            name=name, secret=secret, device=device, deltas="in_place",
        )  # fmt: skip
    else:
        if adapter is not None:
            adapter.refuse_sharded(found.trainer.specs)
        dtypes = {n: t.dtype for n, t in tensors.items()}
        p2p = found.engine_rank is not None  # a link of its own from every rank
        rank = found.engine_rank if found.engine_rank is not None else 0
        recv = ShardedReceiver(
            group=group, rank=rank, trainer=found.trainer,
            engine=EngineLayout.whole(
                found.trainer.specs, receivers=found.engines if p2p else 1, dtype=dtypes
            ),
            params=tensors, addresses={r: a for r, a in enumerate(found.addresses) if a},
            on_commit=on_commit, name=name, device=device, secret=secret,
            around_load=load, point_to_point=p2p,
        )  # fmt: skip
    await asyncio.to_thread(recv.start, timeout)
    return recv
