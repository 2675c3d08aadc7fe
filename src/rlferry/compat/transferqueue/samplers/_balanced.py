"""``SeqlenBalancedSampler``: whole GRPO groups spread over data-parallel ranks by tokens,
and the largest differencing method (Karmarkar-Karp) that balances them."""

from __future__ import annotations

import heapq
from typing import Any

from ._grpo import GRPOGroupNSampler

__all__ = ["SeqlenBalancedSampler", "get_seqlen_balanced_partitions"]


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
