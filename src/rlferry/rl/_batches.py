"""The demo's training batches: a step's finished groups taken from the coordinator,
scored, and put into the queue for the trainer ranks; the next step's while this one
trains.

A batch taken ahead is counted against the weights that will train it, the next
version's (``Coordinator.batch(trainer_version=...)``): the staleness bound holds as if
it had been taken after the update. With it the trainer ranks start their next step as
soon as the update ends, not after the driver took, scored and put a batch: on one H200
under MPS (``rlferry demo --device cuda --model qwen3-0.6b --steps 40 --engines 1``,
alternated in one call) 0.103 and 0.102 s a step against 0.113 and 0.116 taken after
the update, the GPU busy 71% against 62%; the driver's 15-18 ms of scoring and putting
leave the ranks' path (and the requests the update let go start after the next train
command, not before it: ``Engines.guard``).
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
    queue client), ``groups`` GRPO groups of ``group_size`` samples a step. ``sync``: the
    engines get each update (the version moves)."""

    def __init__(
        self, slots: Engines, coord: Coordinator, produced: Producer, client: Any, *,
        groups: int, group_size: int, sync: bool,
    ) -> None:  # fmt: skip
        self._slots, self._coord, self._produced, self._client = slots, coord, produced, client
        self._groups, self._size, self._sync = groups, group_size, sync
        self._ahead: tuple[int, asyncio.Task[Taken]] | None = None

    async def take(self, step: int) -> Taken:
        """Step ``step``'s batch, in the queue: the one taken ahead, or taken now. While
        one taken ahead still waits for its rollouts, a fleet that lost every engine is
        caught up (the trainer ranks are idle: ``Engines.idle``)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return await self._prepare(step, None)
        at, task = ahead
        assert at == step, f"a batch taken ahead for step {at}, asked for {step}"
        return await self._slots.idle(task)

    def ready(self, step: int) -> bool:
        """Whether step ``step``'s batch was taken ahead and is in the queue."""
        return self._ahead is not None and self._ahead[0] == step and self._ahead[1].done()

    def ahead(self, step: int) -> None:
        """Start taking step ``step``'s batch while the trainer ranks train the step before
        (its update not pushed yet, the update before it maybe still pushing): counted
        against the version that step's update makes (the demo's versions are its steps)."""
        trainer = step - 1 if self._sync else self._coord.version
        self._ahead = (step, asyncio.ensure_future(self._prepare(step, trainer)))

    def cancel(self) -> None:
        """Stop taking a batch ahead (the run ended before its step: its error is another)."""
        if self._ahead is not None:
            task = self._ahead[1]
            self._ahead = None
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _prepare(self, step: int, trainer: int | None) -> Taken:
        groups = await self._slots.batch(self._groups, timeout=600, trainer_version=trainer)
        at = time.monotonic()
        version = self._coord.version if trainer is None else trainer
        lags = [version - min(c.versions) for g in groups for c in g.completions]
        rewards, uids = self._produced.score(groups)
        data, meta = rollout_columns(groups)
        data["advantages"] = group_advantages(torch.tensor(rewards), self._size)
        meta["reward"] = rewards
        asyncio.get_running_loop().call_soon(kill_point, "put", step)
        await self._client.put(f"train_{step}", data, meta=meta, timeout=60)
        return Taken(rewards, uids, lags, at)
