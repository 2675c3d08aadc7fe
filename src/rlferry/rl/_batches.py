"""The demo's training batches: a step's finished groups taken from the coordinator,
scored, and put into the queue for the trainer ranks.

The next step's batch is not taken while this one trains (``Coordinator.batch(
trainer_version=...)`` allows it): on one GPU the driver's time between steps lets the
engine generate alone; taken ahead, the ranks' and the engine's kernels overlap more and
the asynchronous step took 156 and 177 ms against 167 and 171 (``rlferry demo --device cuda
--model qwen3-0.6b --steps 40 --engines 1``, one H200, alternated in one call), the ranks'
step 115-124 ms against 99; on the CPU, 98-100 ms a step either way.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import torch

from rlferry.control import Coordinator, rollout_columns

from ._producer import Producer
from .checkpoints import kill_point
from .faults import Engines
from .grpo import group_advantages

__all__ = ["Batches", "Taken"]


@dataclass(frozen=True)
class Taken:
    """A step's batch, in the queue: its rewards and uids (the producer's), each sample's
    lag behind the weights that train it, and when its groups were taken (monotonic)."""

    rewards: list[float]
    uids: list[str]
    lags: list[int]
    at: float


class Batches:
    """Step ``s``'s batch goes into queue partition ``train_{s}`` (``client``: an async
    queue client), ``groups`` GRPO groups of ``group_size`` samples a step."""

    def __init__(
        self, slots: Engines, coord: Coordinator, produced: Producer, client: Any, *,
        groups: int, group_size: int,
    ) -> None:  # fmt: skip
        self._slots, self._coord, self._produced, self._client = slots, coord, produced, client
        self._groups, self._size = groups, group_size

    async def take(self, step: int) -> Taken:
        """Step ``step``'s batch, in the queue."""
        groups = await self._slots.batch(self._groups, timeout=600)
        at = time.monotonic()
        lags = [self._coord.version - min(c.versions) for g in groups for c in g.completions]
        rewards, uids = self._produced.score(groups)
        data, meta = rollout_columns(groups)
        data["advantages"] = group_advantages(torch.tensor(rewards), self._size)
        meta["reward"] = rewards
        asyncio.get_running_loop().call_soon(kill_point, "put", step)
        await self._client.put(f"train_{step}", data, meta=meta, timeout=60)
        return Taken(rewards, uids, lags, at)
