"""The sampler protocol (``BaseSampler``) and the default, ``SequentialSampler``.

A sampler is called as ``sampler(ready_indexes, batch_size, partition=..., **sampling_config)``
and returns ``(sampled, consumed)``; the controller marks ``consumed`` as read by the task.
``partition`` answers ``get_custom_meta(indexes) -> {index: dict}``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["BaseSampler", "SequentialSampler"]


class BaseSampler(ABC):
    """The sampler protocol. ``_states[partition][task][dp_rank][batch_index]`` caches results
    so that every rank of one data-parallel group gets the same samples."""

    def __init__(self) -> None:
        self._states: dict[Any, Any] = {}

    @abstractmethod
    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """``(sampled, consumed)`` global indexes chosen from ``ready_indexes``."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        return self.sample(*args, **kwargs)

    def has_cached_result(
        self, partition_id: str, task_name: str, sampling_config: dict[str, Any] | None = None
    ) -> bool:
        config = sampling_config or {}
        dp_rank = config.get("dp_rank")
        if dp_rank is None:
            return False
        states = self._states.get(partition_id, {}).get(task_name, {})
        return dp_rank in states and config.get("batch_index") in states[dp_rank]

    def clear_cache(self, partition_id: str) -> None:
        self._states.pop(partition_id, None)

    def save_checkpoint(self) -> dict[str, Any]:
        return {"_states": self._states}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        self._states = state["_states"]


class SequentialSampler(BaseSampler):
    """The first ``batch_size`` ready samples (all of them when fewer are ready)."""

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        sampled = ready_indexes[:batch_size]
        return sampled, sampled
