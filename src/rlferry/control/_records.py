"""What the coordinator hands out: finished groups and its statistics."""

from __future__ import annotations

from typing import Any

import msgspec

from ._engine import Completion

__all__ = ["CoordinatorStatistics", "Group"]


class Group(msgspec.Struct, frozen=True, kw_only=True):
    """The ``n`` completions of one submitted prompt (a GRPO group when ``n > 1``)."""

    group: Any
    prompt_ids: list[int]
    completions: list[Completion]

    @property
    def version_start(self) -> int:
        """The oldest weight version any of its tokens came from."""
        return min(c.version_start for c in self.completions)

    @property
    def version_end(self) -> int:
        return max(c.version_end for c in self.completions)


class CoordinatorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """The coordinator's state and counters (samples, not groups, unless named)."""

    version: int
    max_staleness: int
    engines: int
    engines_serving: int
    running: int
    ready_groups: int
    accepted: int
    consumed: int
    dropped: int
    regenerated: int
    capacity: int
    staleness_mean: float
    staleness_max: int
    updates: int
    pause_seconds: float
    push_seconds: float
    update_seconds: float
    waiting_submits: int
    failed_groups: int = 0
    not_serving: dict[str, str] = {}
    """Each engine in the fleet that gets no rollouts, or that left it, and why."""
