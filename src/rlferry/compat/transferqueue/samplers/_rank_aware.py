"""``RankAwareSampler``: every rank of one data-parallel group gets the same samples."""

from __future__ import annotations

from typing import Any

from ._base import BaseSampler

__all__ = ["RankAwareSampler"]


class RankAwareSampler(BaseSampler):
    """Every caller with one ``(partition, task, dp_rank, batch_index)`` gets the same samples:
    the first samples them, the others read its cached answer."""

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        dp_rank: int,
        batch_index: int,
        task_name: str,
        partition_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        ranks = self._states.setdefault(partition_id, {}).setdefault(task_name, {})
        batches = ranks.setdefault(dp_rank, {})
        if batch_index in batches:
            sampled = batches[batch_index]
            return sampled, sampled
        sampled = ready_indexes[:batch_size]
        if len(sampled) < batch_size:
            return [], []
        batches[batch_index] = sampled
        return sampled, sampled
