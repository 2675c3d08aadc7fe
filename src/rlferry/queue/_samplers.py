"""Samplers: which ready samples one batch round gives to each DP rank.

A sampler sees the samples ready for a task, in the order they arrived, and
forms one *round*: ``dp_size`` shares of ``batch_size`` samples each, or None
when there are not enough yet. Samplers are data (tagged msgspec structs), so
a client names one and the controller runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from ._errors import SchemaError

__all__ = ["GrpoGroups", "Sampler", "SeqlenBalanced", "Sequential", "sampler_from"]

Meta = Callable[[int, str], Any]  # (index, key) -> that sample's meta value


class Sequential(msgspec.Struct, frozen=True, tag="sequential"):
    """The first ``dp_size * batch_size`` ready samples, in arrival order, cut in rank order."""

    def round(
        self, ready: Sequence[int], meta: Meta, batch_size: int, dp_size: int
    ) -> list[list[int]] | None:
        need = batch_size * dp_size
        if len(ready) < need:
            return None
        return [list(ready[r * batch_size : (r + 1) * batch_size]) for r in range(dp_size)]


class GrpoGroups(msgspec.Struct, frozen=True, tag="grpo_groups"):
    """Whole groups (samples sharing ``meta[key]``), never split across ranks or batches.

    A group is ready once ``group_size`` of its samples are; ``batch_size`` must
    be a multiple of ``group_size``.
    """

    group_size: int
    key: str = "group"

    def __post_init__(self) -> None:
        if type(self.group_size) is not int or self.group_size < 1:
            raise SchemaError(f"group_size: expected an int >= 1, got {self.group_size!r}")

    def round(
        self, ready: Sequence[int], meta: Meta, batch_size: int, dp_size: int
    ) -> list[list[int]] | None:
        if batch_size % self.group_size:
            raise SchemaError(
                f"batch_size: expected a multiple of group_size {self.group_size}, "
                f"got {batch_size} (grpo_groups never splits a group)"
            )
        groups: dict[Any, list[int]] = {}
        complete: list[list[int]] = []
        per_rank = batch_size // self.group_size
        for index in ready:
            members = groups.setdefault(_hashable(meta(index, self.key)), [])
            members.append(index)
            if len(members) == self.group_size:
                complete.append(members)
                if len(complete) == per_rank * dp_size:
                    return [
                        [i for g in complete[r * per_rank : (r + 1) * per_rank] for i in g]
                        for r in range(dp_size)
                    ]
        return None


class SeqlenBalanced(msgspec.Struct, frozen=True, tag="seqlen_balanced"):
    """The first ``dp_size * batch_size`` ready samples, shared so that every rank's
    total ``meta[key]`` (sequence length) is as even as a greedy longest-first split makes it."""

    key: str = "seqlen"

    def round(
        self, ready: Sequence[int], meta: Meta, batch_size: int, dp_size: int
    ) -> list[list[int]] | None:
        first = Sequential().round(ready, meta, batch_size, dp_size)  # which samples
        if first is None:
            return None
        chosen = [i for share in first for i in share]
        lengths = {}
        for i in chosen:
            value = meta(i, self.key)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise SchemaError(
                    f"meta `{self.key}`: expected a number for sample {i}, got {value!r} "
                    f"(put meta={{'{self.key}': [...]}} with every sample's length)"
                )
            lengths[i] = value
        shares: list[list[int]] = [[] for _ in range(dp_size)]
        totals = [0.0] * dp_size
        for i in sorted(chosen, key=lambda i: -lengths[i]):
            open_ranks = [r for r in range(dp_size) if len(shares[r]) < batch_size]
            r = min(open_ranks, key=lambda r: totals[r])
            shares[r].append(i)
            totals[r] += lengths[i]
        return [sorted(s, key=chosen.index) for s in shares]


Sampler = Sequential | GrpoGroups | SeqlenBalanced


def sampler_from(value: Any) -> Sampler:
    """A sampler from its name (``"sequential"``, ``"seqlen_balanced"``), an instance,
    or its wire form (the dict ``msgspec.to_builtins`` makes of one)."""
    if isinstance(value, (Sequential, GrpoGroups, SeqlenBalanced)):
        return value
    if isinstance(value, dict):
        try:
            return msgspec.convert(value, Sampler)
        except msgspec.ValidationError as e:
            raise SchemaError(f"sampler: {e}") from None
    if value == "sequential":
        return Sequential()
    if value == "seqlen_balanced":
        return SeqlenBalanced()
    if value == "grpo_groups":
        raise SchemaError(
            "sampler: grpo_groups needs the group size "
            "(pass sampler=GrpoGroups(group_size=G, key='group'))"
        )
    raise SchemaError(
        f"sampler: expected 'sequential', 'seqlen_balanced', GrpoGroups(...) or "
        f"SeqlenBalanced(...), got {value!r}"
    )


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
