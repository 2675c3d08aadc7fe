"""What a client checks before it asks for anything: a put's every value, a call's arguments.

A put is checked whole here, before the controller reserves a sample: a value
that cannot travel, rows that disagree, a meta or partition meta that cannot be
stored, all raise :class:`SchemaError` naming the field, and nothing is held.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from rlferry.wire import RaggedRows, WireError, encode
from rlferry.wire.lowlevel import brief, check_address, tensor_refusal

from ._columns import (
    kind_of,
    nbytes,
    packed_string_columns,
    rows_of,
    shared_columns,
    shared_tensor_columns,
    signature,
)
from ._errors import SchemaError
from ._messages import Alloc

__all__ = [
    "check_partition",
    "check_timeout",
    "checked_address",
    "checked_put",
    "positive",
    "staged",
]

_STAGE_IN_THREAD = 4 << 20  # a put of this many bytes or more copies off the event loop
_SCALARS = frozenset((str, bytes, int, float, bool, type(None)))
_TENSOR_OR_SCALARS = _SCALARS | {torch.Tensor}


def checked_address(address: Any) -> str:
    try:
        return check_address(address)
    except ValueError as e:
        raise SchemaError(str(e)) from None


def check_partition(partition: Any) -> None:
    if not isinstance(partition, str) or not partition:
        raise SchemaError(
            f"partition: expected a non-empty str, got {type(partition).__name__} "
            f"{brief(partition)} (name partitions like 'train_17')"
        )


def positive(name: str, value: Any) -> None:
    if type(value) is not int or value < 1:
        raise SchemaError(f"{name}: expected a positive int, got {brief(value)}")


def check_timeout(timeout: Any) -> None:
    if timeout is not None and (type(timeout) not in (int, float) or not timeout >= 0):
        raise SchemaError(f"timeout: expected None or seconds >= 0, got {brief(timeout)}")


def _travels(where: str, values: Any) -> None:
    """Refuse plain values the wire cannot carry, naming where they are."""
    if isinstance(values, list):
        flat = values.flat if type(values) is RaggedRows else None
        if flat is not None and tensor_refusal(flat) is None:  # its rows are views of it
            return
        kinds = set(map(type, values))
        if kinds <= _SCALARS:
            return
        if kinds <= _TENSOR_OR_SCALARS:  # tensors: checked without encoding their data
            for i, v in enumerate(values):
                why = tensor_refusal(v) if type(v) is torch.Tensor else None
                if why is not None:
                    raise SchemaError(f"{where}, at `$[{i}]`: cannot travel: {why}")
            return
    try:
        encode(values)
    except WireError as e:
        raise SchemaError(str(e).replace("cannot encode `$", f"{where}, at `$", 1)) from None


def checked_put(
    partition: Any,
    data: Any,
    meta: Any,
    indexes: Any,
    partition_meta: Any,
    timeout: Any,
) -> Alloc:
    """The controller request of a put, once every value of it was checked."""
    check_partition(partition)
    if not isinstance(data, dict) or not data:
        raise SchemaError(
            f"data: expected a dict of field name -> column, got {brief(data)} "
            "(e.g. {'tokens': [...], 'rewards': torch.tensor([...])})"
        )
    rows = -1
    first = ""
    signatures = {}
    for name, column in data.items():
        if not isinstance(name, str) or not name:
            raise SchemaError(f"field {brief(name)}: expected a non-empty str name")
        kind = kind_of(name, column)
        n = rows_of(column)
        if rows < 0:
            rows, first = n, name
        elif n != rows:
            raise SchemaError(
                f"field `{name}`: expected {rows} rows (as field `{first}`), got {n} "
                "(every field of one put must have the same number of samples)"
            )
        signatures[name] = signature(kind, column)
        if isinstance(column, list):
            _travels(f"field `{name}`", column)
    if rows == 0:
        raise SchemaError("data: expected at least one sample, got 0 rows")
    meta = dict(meta or {})
    for key, values in meta.items():
        if not isinstance(key, str) or not key:
            raise SchemaError(f"meta {brief(key)}: expected a non-empty str key")
        if not isinstance(values, (list, tuple)) or len(values) != rows:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise SchemaError(
                f"meta `{key}`: expected a list of {rows} values (one per sample), got {got}"
            )
        meta[key] = list(values)
        _travels(f"meta `{key}`", meta[key])
    if indexes is not None:
        indexes = list(indexes)
        if len(indexes) != rows or not all(type(i) is int and i >= 0 for i in indexes):
            raise SchemaError(
                f"indexes: expected {rows} ints >= 0 (one per row of data), got {brief(indexes)}"
            )
        if len(set(indexes)) != rows:
            raise SchemaError(
                f"indexes: expected {rows} distinct ints, got a repeated one in "
                f"{brief(indexes)} (one row of data per sample)"
            )
    if partition_meta is not None:
        if not isinstance(partition_meta, dict) or not all(
            isinstance(k, str) and k for k in partition_meta
        ):
            raise SchemaError(
                f"partition_meta: expected a dict with str keys, got {brief(partition_meta)} "
                "(e.g. {'num_microbatches': 4})"
            )
        _travels("partition_meta", partition_meta)
    check_timeout(timeout)
    return Alloc(partition, rows, signatures, meta, partition_meta, indexes, timeout)


async def staged(data: dict[str, Any]) -> dict[str, Any]:
    """The columns with their bulk in shared memory (the one copy a put makes); a large put
    copies its tensors and packs its strings side by side, off the event loop."""
    if sum(map(nbytes, data.values())) < _STAGE_IN_THREAD:
        return shared_columns(data)
    moved = await asyncio.gather(
        asyncio.to_thread(shared_tensor_columns, data),
        asyncio.to_thread(packed_string_columns, data),
    )
    return {**data, **moved[0], **moved[1]}
