"""The caches a model of an :class:`~rlferry.engines.hf.HFEngine` sees over its slot KV
cache (``_slots.py``): one for a decode step, one for a prefill. Both write the new keys and
values straight into the rows' slots; the positions and the mask are given, so nothing is
derived from a cached length."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PrefillCache", "SlotCache"]


def _cache_class() -> Any:
    from transformers.cache_utils import Cache

    return Cache


class SlotCache(_cache_class()):  # type: ignore[misc]
    """The cache the model sees in a decode step over slots ``[0, B)`` and columns
    ``[0, W)``: row ``i`` writes its new key and value at column ``pos[i]`` of its slot
    and attends over those ``W`` columns (the mask hides those it does not use)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], pos: torch.Tensor):
        super().__init__(layers=[])
        self.k, self.v, self.pos = keys, values, pos

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *a: Any,
        **kw: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        k, v = self.k[layer_idx], self.v[layer_idx]
        # row i's key and value to column pos[i] of slot i: a scatter along the columns
        # (one small kernel; an indexing by slots and columns took 9 us on an H200)
        at = self.pos.view(-1, 1, 1, 1).expand(-1, k.shape[1], 1, k.shape[3])
        k.scatter_(2, at, key_states)
        v.scatter_(2, at, value_states)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and the mask are given: nothing is derived from it

    def get_mask_sizes(self, *a: Any, **kw: Any) -> tuple[int, int]:
        return self.k[0].shape[2], 0

    @property
    def is_compileable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self.k)


class PrefillCache(_cache_class()):  # type: ignore[misc]
    """The cache a prefill sees: each layer writes the prompt's keys and values straight
    into the rows' slots (position ``j`` of row ``i`` to ``slot[i, j]``, column
    ``col[i, j]``) and attends over the prompt's own (nothing was cached before it)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 slot: torch.Tensor, col: torch.Tensor) -> None:  # fmt: skip
        super().__init__(layers=[])
        self.k, self.v, self.slot, self.col = keys, values, slot, col

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *a: Any,
        **kw: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        self.k[layer_idx][self.slot, :, self.col] = key_states.transpose(1, 2)
        self.v[layer_idx][self.slot, :, self.col] = value_states.transpose(1, 2)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, *a: Any, **kw: Any) -> tuple[int, int]:
        return self.col.shape[1], 0

    @property
    def is_compileable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self.k)
