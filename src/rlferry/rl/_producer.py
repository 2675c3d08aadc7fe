"""The demo's producer: prompts drawn from a seeded RNG, one GRPO group each, submitted to
the coordinator and kept until their group is trained.

Group ``k`` is the ``k``-th prompt drawn. Its state (the RNG, the next ``k``, the
prompts drawn and not trained yet) is a job checkpoint's: a resumed run submits the
untrained prompts again, oldest first, then draws on where the checkpoint left off.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from rlferry.control import Coordinator, Group, SamplingParams

from .task import Prompt, ReverseTask

__all__ = ["Producer"]


class Producer:
    def __init__(self, task: ReverseTask, seed: int, state: dict[str, Any] | None = None) -> None:
        self.task = task
        self.rng = random.Random(seed)
        self.next = 0
        self.open: dict[int, Prompt] = {}  # drawn, not trained yet
        if state is not None:
            version, internal, gauss = state["rng"]
            self.rng.setstate((version, tuple(internal), gauss))
            self.next = state["next"]
            self.open = {int(k): Prompt(**p) for k, p in state["open"]}

    async def run(self, coord: Coordinator, params: SamplingParams, n: int) -> None:
        """Submit the open prompts again (a resumed run's), then draw and submit forever."""
        for k in sorted(self.open):
            await coord.submit(self.open[k].ids, params, n=n, group=k)
        while True:
            k = self.next
            prompt = self.task.sample(1, self.rng)[0]
            self.open[k] = prompt
            self.next = k + 1
            await coord.submit(prompt.ids, params, n=n, group=k)

    def score(self, groups: list[Group]) -> tuple[list[float], list[str]]:
        """The rewards of ``groups``' samples and their uids (``"k/i"``: the ``i``-th
        sample of group ``k``); the groups are trained from here on."""
        rewards, uids = [], []
        for g in groups:
            prompt = self.open.pop(g.group)
            for i, c in enumerate(g.completions):
                rewards.append(self.task.reward(prompt, c.token_ids))
                uids.append(f"{g.group}/{i}")
        return rewards, uids

    def state(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {
            "rng": [version, list(internal), gauss],
            "next": self.next,
            "open": [[k, dataclasses.asdict(p)] for k, p in sorted(self.open.items())],
        }
