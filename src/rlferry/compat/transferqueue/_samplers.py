"""TransferQueue's samplers: which ready samples a ``get_meta`` returns.

A sampler is called as ``sampler(ready_indexes, batch_size, partition=..., **sampling_config)``
and returns ``(sampled, consumed)``; the controller marks ``consumed`` as read by the task.
``partition`` answers ``get_custom_meta(indexes) -> {index: dict}``.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import Any

__all__ = [
    "BaseSampler",
    "GRPOGroupNSampler",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "get_seqlen_balanced_partitions",
]


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


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """Whole GRPO groups for all ``dp_size`` ranks at once, spread over the ranks so that each
    gets about the same number of tokens (custom meta ``total_lengths`` per sample; 1 when
    absent), by Karmarkar-Karp. ``batch_size`` is per rank."""

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1) -> None:
        super().__init__(n_samples_per_prompt=n_samples_per_prompt)
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.dp_size = dp_size
        self._balanced_cache: dict[tuple[Any, ...], list[list[int]]] = {}

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        dp_rank = kwargs.get("dp_rank", 0)
        batch_index = kwargs.get("batch_index", 0)
        key = (partition_id, task_name, batch_index)
        if key not in self._balanced_cache:
            picked, _ = super().sample(
                ready_indexes,
                batch_size * self.dp_size,
                task_name=task_name,
                partition_id=partition_id,
            )
            if not picked:
                return [], []
            self._balanced_cache[key] = self._spread(picked, kwargs.get("partition"))
            ranks = self._states.setdefault(partition_id, {}).setdefault(task_name, {})
            for r in range(self.dp_size):
                mine = self._balanced_cache[key][r] if r < len(self._balanced_cache[key]) else []
                ranks.setdefault(r, {})[batch_index] = (mine, list(mine))
        parts = self._balanced_cache[key]
        sampled = parts[dp_rank] if dp_rank < len(parts) else []
        return sampled, list(sampled)

    def _spread(self, picked: list[int], partition: Any) -> list[list[int]]:
        if partition is None:  # no lengths to balance: equal slices, the last takes the rest
            size = len(picked) // self.dp_size
            return [
                picked[r * size : (r + 1) * size if r < self.dp_size - 1 else len(picked)]
                for r in range(self.dp_size)
            ]
        meta = partition.get_custom_meta(picked)
        lengths = [meta.get(i, {}).get("total_lengths", 1) for i in picked]
        g = self.n_samples_per_prompt
        groups, rest = divmod(len(lengths), g)
        if groups > 0 and rest == 0:
            weights = [sum(lengths[k * g : (k + 1) * g]) for k in range(groups)]
            parts = get_seqlen_balanced_partitions(weights, self.dp_size, equal_size=True)
            return [[picked[k * g + s] for k in part for s in range(g)] for part in parts]
        parts = get_seqlen_balanced_partitions(lengths, self.dp_size, equal_size=False)
        return [[picked[i] for i in part] for part in parts]

    def clear_cache(self, partition_id: str) -> None:
        super().clear_cache(partition_id)
        for key in [k for k in self._balanced_cache if k[0] == partition_id]:
            del self._balanced_cache[key]

    def save_checkpoint(self) -> dict[str, Any]:
        return {**super().save_checkpoint(), "_balanced_cache": self._balanced_cache}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        super().load_checkpoint(state)
        self._balanced_cache = state["_balanced_cache"]


class _Bin:
    """A set of (index, weight) items and their sum; ordered by sum, then size, then items."""

    __slots__ = ("items", "total")

    def __init__(self) -> None:
        self.total = 0
        self.items: list[tuple[int, int]] = []

    def key(self) -> tuple[int, int, list[tuple[int, int]]]:
        return (self.total, len(self.items), self.items)


class _Split:
    """k bins, heaviest first; the heap pops the split whose bins differ most."""

    __slots__ = ("bins",)

    def __init__(self, items: list[tuple[int, int]], k: int) -> None:
        self.bins = [_Bin() for _ in range(k)]
        for b, (idx, w) in zip(self.bins, items, strict=False):
            b.items.append((idx, w))
            b.total += w
        self.bins.sort(key=_Bin.key, reverse=True)

    def spread(self) -> int:
        return self.bins[0].total - self.bins[-1].total

    def merge(self, other: _Split) -> None:
        for mine, theirs in zip(self.bins, reversed(other.bins), strict=True):
            mine.items.extend(theirs.items)
            mine.total += theirs.total
        self.bins.sort(key=_Bin.key, reverse=True)

    def __lt__(self, other: _Split) -> bool:
        if self.spread() != other.spread():
            return self.spread() > other.spread()
        return self.bins[0].key() > other.bins[0].key()


def get_seqlen_balanced_partitions(
    seqlen_list: list[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """Positions of ``seqlen_list`` in ``k_partitions`` parts of near-equal sums (the largest
    differencing method); with ``equal_size`` every part has the same count. Parts sorted."""
    n = len(seqlen_list)
    if n < k_partitions:
        raise AssertionError(f"number of items:[{n}] < k_partitions:[{k_partitions}]")
    order = sorted((w, i) for i, w in enumerate(seqlen_list))
    heap: list[_Split] = []
    if equal_size:
        if n % k_partitions:
            raise AssertionError(f"{n} % {k_partitions} != 0")
        for start in range(0, n, k_partitions):
            items = [(i, w) for w, i in order[start : start + k_partitions]]
            heapq.heappush(heap, _Split(items, k_partitions))
    else:
        for w, i in order:
            heapq.heappush(heap, _Split([(i, w)], k_partitions))
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        a.merge(b)
        heapq.heappush(heap, a)
    parts = [sorted(i for i, _ in b.items) for b in heap[0].bins]
    if any(not p for p in parts):
        raise AssertionError("a partition is empty")
    return parts
