"""TransferQueue's KV API: samples named by key in a partition (``kv_put``, ``kv_batch_put``,
``kv_batch_get``, ``kv_list``, ``kv_clear``) and their ``async_`` twins."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .._errors import NotInitialized
from ..backends import RemoteController
from ..metadata import KVBatchMeta, kv_meta_owning
from ._interface import api_client
from ._process import current_backend

__all__ = [
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
]

T = TypeVar("T")


def kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Put one sample under ``key``: its fields (a dict of per-sample values or a TensorDict
    of one row) and/or its tag. Returns the key's KVBatchMeta with every field it holds."""
    if fields is None and tag is None:
        raise ValueError("Please provide at least one parameter of fields or tag.")
    if fields is not None:
        fields = _one_row(fields)
    return _kv_put([key], partition_id, fields, None if tag is None else [tag], data_parser)


def _one_row(fields: Any) -> Any:
    from tensordict import NonTensorStack, TensorDict

    if isinstance(fields, TensorDict):
        return fields
    if not isinstance(fields, dict):
        raise ValueError(
            f"fields: expected a dict or a TensorDict, got {type(fields).__name__} "
            "(`fields` can only be dict or TensorDict)"
        )
    row: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise ValueError(
                    f"field `{name}`: expected one sample's value, got a nested tensor (a batch: "
                    "Please use (async)kv_batch_put for batch operation)"
                )
            row[name] = value.unsqueeze(0)
        else:
            row[name] = NonTensorStack(value)
    return TensorDict(row, batch_size=[1])


def _kv_put(
    keys: list[str],
    partition_id: str,
    fields: Any,
    tags: list[dict[str, Any]] | None,
    data_parser: Callable[[Any], Any] | None,
) -> KVBatchMeta:
    client = api_client()
    if fields is not None and fields.batch_size[0] != len(keys):
        raise ValueError(
            f"`keys` with length {len(keys)} does not match the `fields` TensorDict with "
            f"batch_size {fields.batch_size[0]}: expected one row per key"
        )
    if tags is not None and len(tags) != len(keys):
        raise ValueError(
            f"keys with length {len(keys)} does not match length of tags {len(tags)}: "
            "expected one tag dict per key"
        )
    meta = client.kv_retrieve_meta(keys=keys, partition_id=partition_id, create=True)
    if meta.size != len(keys):
        raise RuntimeError(
            f"Retrieved BatchMeta size {meta.size} does not match with input `keys` size "
            f"{len(keys)}: expected one sample per key (duplicated keys?)"
        )
    if tags is not None:
        meta.update_custom_meta(tags)
    if fields is not None:
        meta = client.put(fields, meta, data_parser=data_parser)
    else:
        client.set_custom_meta(meta)
    if tags is not None:
        return KVBatchMeta(
            keys=list(keys),
            tags=meta.custom_meta,
            partition_id=partition_id,
            fields=meta.field_names,
            extra_info=meta.extra_info,
        )
    # tags and extra_info made for this call alone: no deep copy
    return kv_meta_owning(
        list(keys), meta.custom_meta, partition_id, meta.field_names, copy.deepcopy(meta.extra_info)
    )


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Put many samples, one row of ``fields`` (a TensorDict) and one tag per key."""
    if fields is None and tags is None:
        raise ValueError("Please provide at least one parameter of `fields` or `tags`.")
    return _kv_put(list(keys), partition_id, fields, tags, data_parser)


def kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> Any:
    """The values of ``keys`` (all their common fields, or ``select_fields``), a TensorDict.

    Raises:
        ValueError: no such keys or partition, or a field some of the keys lack.
    """
    client = api_client()
    meta = client.kv_retrieve_meta(keys=keys, partition_id=partition_id, create=False)
    if meta.size == 0:
        raise ValueError(
            f"keys or partition were not found! expected keys {keys!r} in partition "
            f"`{partition_id}` (partitions: {client.get_partition_list()})"
        )
    wanted = [keys] if isinstance(keys, str) else list(keys)
    if meta.size < len(set(wanted)):  # TransferQueue returns the others without a word
        found = set(client.kv_retrieve_keys(list(map(int, meta.global_indexes)), partition_id))
        missing = [k for k in wanted if k not in found]
        raise ValueError(
            f"keys were not found! expected keys of partition `{partition_id}`, got "
            f"{missing[:8]!r} that it does not hold (kv_put them first, or leave them out)"
        )
    if not meta.field_names:
        raise ValueError(
            f"no fields to read! expected keys {wanted[:8]!r} of `{partition_id}` with fields, "
            "got keys that hold only tags (kv_put their fields first)"
        )
    if select_fields is not None:
        wanted = [select_fields] if isinstance(select_fields, str) else list(select_fields)
        lacking = [f for f in wanted if f not in meta.field_schema]
        if lacking:
            raise ValueError(
                f"Some fields are not ready in all the requested keys! expected fields {lacking} "
                f"in each of {meta.size} keys of `{partition_id}`, got keys without them "
                f"(fields all these keys hold: {meta.field_names})"
            )
        meta = meta.select_fields(wanted)
    if not meta.is_ready:
        raise ValueError(
            f"Some fields are not ready in all the requested keys! expected fields "
            f"{meta.field_names or select_fields} for each of {meta.size} keys of "
            f"`{partition_id}`, "
            "got some keys without them (kv_batch_get keys that have the same fields)"
        )
    return client.get_data(meta)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Any:
    """``kv_batch_get`` for the keys, partition and fields of a ``KVBatchMeta``."""
    if meta.partition_id is None:
        raise ValueError("Must provide partition_id in the input KVBatchMeta.")
    fields = meta.fields
    if select_fields is not None:
        fields = [select_fields] if isinstance(select_fields, str) else list(select_fields)
        if meta.fields is None or any(f not in meta.fields for f in fields):
            raise ValueError(
                f"Some fields assigned in select_fields not found in the metadata. "
                f"Assigned: {fields}; Fields in KVBatchMeta: {meta.fields}."
            )
    return kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """``{partition: {key: tags}}`` of one partition or all."""
    return api_client().kv_list(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Drop the samples of ``keys`` (keys that do not exist are ignored)."""
    client = api_client()
    meta = client.kv_retrieve_meta(
        keys=[keys] if isinstance(keys, str) else keys, partition_id=partition_id, create=False
    )
    if meta.size > 0:
        client.clear_samples(meta)


async def _off(fn: Callable[..., T], *args: Any) -> T:
    """A KV call for its ``async_`` twin: with the queue as a service, on a thread (the
    caller's event loop goes on while it waits for the service); embedded, here."""
    try:
        served = isinstance(current_backend().controller, RemoteController)
    except NotInitialized:
        served = False  # the call raises it, named
    if served:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def async_kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    return await _off(kv_put, key, partition_id, fields, tag, data_parser)


async def async_kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    return await _off(kv_batch_put, keys, partition_id, fields, tags, data_parser)


async def async_kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> Any:
    return await _off(kv_batch_get, keys, partition_id, select_fields)


async def async_kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: list[str] | str | None = None
) -> Any:
    return await _off(kv_batch_get_by_meta, meta, select_fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    return await _off(kv_list, partition_id)


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    await _off(kv_clear, keys, partition_id)
