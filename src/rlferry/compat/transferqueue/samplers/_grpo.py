"""``GRPOGroupNSampler``: whole prompt groups of consecutive global indexes."""

from __future__ import annotations

from typing import Any

from ._base import BaseSampler

__all__ = ["GRPOGroupNSampler"]


class GRPOGroupNSampler(BaseSampler):
    """Whole prompt groups: ``n_samples_per_prompt`` consecutive global indexes, all ready.

    Returns ``([], [])`` until ``batch_size // n_samples_per_prompt`` whole groups are ready.
    """

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if n_samples_per_prompt <= 0:
            raise ValueError(
                f"n_samples_per_prompt must be positive, got {n_samples_per_prompt} "
                "(the number of responses per prompt)"
            )
        self.n_samples_per_prompt = n_samples_per_prompt

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        states = self._states.get(partition_id, {}).get(task_name, {})
        dp_rank = kwargs.get("dp_rank")
        batch_index = kwargs.get("batch_index")
        if dp_rank in states and batch_index in states[dp_rank]:
            cached: tuple[list[int], list[int]] = states[dp_rank][batch_index]
            return cached
        n = self.n_samples_per_prompt
        if batch_size % n != 0:
            raise ValueError(
                f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({n})"
            )
        need = batch_size // n
        ready = sorted(ready_indexes)
        picked: list[int] = []
        i = 0
        while i <= len(ready) - n and len(picked) < batch_size:
            if ready[i + n - 1] - ready[i] == n - 1:  # sorted and distinct: n consecutive
                picked.extend(ready[i : i + n])
                i += n
            else:
                i += 1
        if len(picked) < need * n:
            return [], []
        result = (picked, list(picked))
        if dp_rank is not None:
            states.setdefault(dp_rank, {}).setdefault(batch_index, result)
            self._states.setdefault(partition_id, {})[task_name] = states
        return result
