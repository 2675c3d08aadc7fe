"""Finished groups as queue columns: what a trainer gets from ``rlferry.queue``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlferry.errors import RequestError
from rlferry.queue import AsyncQueueClient
from rlferry.wire import RaggedRows
from rlferry.wire.lowlevel import joined_numbers

from ._coordinator import Group

__all__ = ["put_groups", "rollout_columns"]


def rollout_columns(
    groups: Sequence[Group],
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The columns and per-sample meta of ``groups``, one row per completion.

    Columns (ragged fields are lists of 1-d tensors, :class:`~rlferry.wire.RaggedRows`:
    views of one tensor, which the queue sends whole): ``prompt_ids`` (int64),
    ``response_ids`` (int64), ``logprobs`` (float32, the engine's), ``versions`` (int64,
    per token). Meta: ``group`` (the group's index in ``groups`` unless ``Group.group``
    is set), ``version_start``, ``version_end``, ``finish_reason``, ``engine``,
    ``response_len``.
    """
    if not groups:
        raise RequestError("groups: expected at least one finished group, got none")
    meta: dict[str, list[Any]] = {
        k: [] for k in ("group", "version_start", "version_end", "finish_reason", "engine",
                        "response_len")
    }  # fmt: skip
    done = []
    for g, group in enumerate(groups):
        name = g if group.group is None else group.group
        for c in group.completions:
            done.append(c)
            meta["group"].append(name)
            meta["version_start"].append(c.version_start)
            meta["version_end"].append(c.version_end)
            meta["finish_reason"].append(c.finish_reason)
            meta["engine"].append(c.engine)
            meta["response_len"].append(len(c.token_ids))
    data = {
        "prompt_ids": _ragged([c.prompt_ids for c in done], torch.int64),
        "response_ids": _ragged([c.token_ids for c in done], torch.int64),
        "logprobs": _ragged([c.logprobs for c in done], torch.float32),
        "versions": _ragged([c.versions for c in done], torch.int64),
    }
    return data, meta


def _ragged(rows: list[list[Any]], dtype: torch.dtype) -> RaggedRows:
    """One 1-d tensor per row, views of one tensor made at once (a tensor per row cost
    ~10 us each: 5 ms a step of the demo's 128 samples), which the queue sends whole."""
    lengths, flat = joined_numbers(rows, dtype)
    return RaggedRows(flat, [[n] for n in lengths.tolist()])


async def put_groups(
    client: AsyncQueueClient,
    partition: str,
    groups: Sequence[Group],
    *,
    partition_meta: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> list[int]:
    """Put ``groups`` into ``partition`` (see :func:`rollout_columns`); their indexes.
    A trainer takes whole groups with ``GrpoGroups(group_size=n, key="group")``."""
    data, meta = rollout_columns(groups)
    return await client.put(
        partition, data, meta=meta, partition_meta=partition_meta, timeout=timeout
    )
