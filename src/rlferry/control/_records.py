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
    """The trainer's version: that of the last update any engine committed."""
    max_staleness: int
    """How many versions a trained sample may lag."""
    engines: int
    """Engines in the fleet."""
    engines_serving: int
    """Engines of the fleet that get rollouts."""
    running: int
    """Samples admitted and generating."""
    ready_groups: int
    """Finished groups waiting for :meth:`Coordinator.batch`."""
    accepted: int
    """Samples finished and kept (ready, or taken by the trainer)."""
    consumed: int
    """Samples the trainer took."""
    dropped: int
    """Samples dropped: too stale when taken, or of a group that failed."""
    regenerated: int
    """Samples generated again after being too stale."""
    capacity: int
    """Samples that may be admitted now (the staleness bound's room)."""
    staleness_mean: float
    """The mean lag of the samples taken, in versions."""
    staleness_max: int
    """The largest lag of a sample taken, in versions."""
    updates: int
    """Weight updates run."""
    pause_seconds: float
    """Seconds the engines took to pause, over all updates."""
    push_seconds: float
    """Seconds of the trainer's pushes, over all updates."""
    update_seconds: float
    """Seconds of whole updates (from the first pause, or the push, to the last resume)."""
    waiting_submits: int
    """``submit`` calls waiting for room in the staleness bound."""
    failed_groups: int = 0
    """Groups that failed (a request refused, or no engine served in time)."""
    not_serving: dict[str, str] = {}
    """Each engine in the fleet that gets no rollouts, or that left it, and why."""
