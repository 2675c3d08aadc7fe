"""What the shim's service and its remote clients send each other, in rlferry's wire forms.

Nothing here is pickled. A ``BatchMeta`` travels as its arrays and strings (global
indexes and production status as numpy arrays, the partition as one string or a list,
the schema with dtypes by name, custom meta as plain dicts); a column travels as a
tensor (dense, or jagged nested as values + offsets), a list of tensors (one frame), or
a list of plain values (str, bytes, numbers, None, lists, dicts, arrays, tensors): what
the wire carries. A value of any other type is refused by the wire, naming its path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlferry.wire.files import FileFormatError

from .._errors import ClientClosed, GetMetaTimeout, NotInitialized, StorageKeyNotFoundError
from ..metadata import BatchMeta, from_arrays, samples_of
from ..state import objects

__all__ = ["ERRORS", "columns_in", "columns_out", "meta_in", "meta_out", "schema_in", "schema_out"]

ERRORS: dict[str, type[Exception]] = {
    c.__name__: c
    for c in (
        AssertionError,
        ClientClosed,
        FileFormatError,
        FileNotFoundError,
        GetMetaTimeout,
        IndexError,
        KeyError,
        NotImplementedError,
        NotInitialized,
        RuntimeError,
        StorageKeyNotFoundError,
        TypeError,
        ValueError,
    )
}
"""The exception types a service's error is raised as again in the client, by name (any
other becomes a ``RuntimeError`` naming its type, as TransferQueue's client reports)."""

_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _dtype_in(name: Any) -> torch.dtype | None:
    if name is None:
        return None
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"schema dtype: expected a torch dtype's name, got {name!r}")
    return dtype


def _shape(shape: Any) -> list[int] | None:
    return None if shape is None else [int(d) for d in shape]


def schema_out(schema: dict[str, dict[str, Any]]) -> dict[str, list[Any]]:
    """``{field: [dtype name, shape, is_nested, is_non_tensor, per-sample shapes]}``."""
    out: dict[str, list[Any]] = {}
    for name, s in schema.items():
        dtype = s.get("dtype")
        per = s.get("per_sample_shapes")
        out[name] = [
            None if dtype is None else str(dtype),
            _shape(s.get("shape")),
            bool(s.get("is_nested")),
            bool(s.get("is_non_tensor")),
            None if per is None else [_shape(p) for p in per],
        ]
    return out


def schema_in(wire: dict[str, list[Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, (dtype, shape, nested, non_tensor, per) in wire.items():
        s: dict[str, Any] = {
            "dtype": _dtype_in(dtype),
            "shape": None if shape is None else torch.Size(shape),
            "is_nested": nested,
            "is_non_tensor": non_tensor,
        }
        if per is not None:
            s["per_sample_shapes"] = [None if p is None else tuple(p) for p in per]
        out[name] = s
    return out


def meta_out(meta: BatchMeta) -> dict[str, Any]:
    """A ``BatchMeta`` made by the controller (no ``extra_info`` yet) as wire values."""
    samples = samples_of(meta)
    return {
        "gi": samples.indexes,
        "pid": samples.partition,
        "schema": schema_out(meta.field_schema),
        "status": meta.production_status,
        "custom": samples.custom,
    }


def meta_in(wire: dict[str, Any]) -> BatchMeta:
    # the arrays are views of the received frame (read-only): the batch gets its own
    gi = np.array(wire["gi"], dtype=np.int64)
    status = np.array(wire["status"], dtype=np.int8)
    return from_arrays(gi, wire["pid"], schema_in(wire["schema"]), status, wire["custom"])


_TENSOR, _STRIDED, _OBJECTS = "t", "s", "o"


def columns_out(columns: dict[str, Any]) -> dict[str, list[Any]]:
    """The store's answer to a get: each column tagged with how to build it again."""
    out: dict[str, list[Any]] = {}
    for name, value in columns.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested and value.layout != torch.jagged:
                out[name] = [_STRIDED, list(value.unbind())]
            else:
                out[name] = [_TENSOR, value]
        else:  # a NonTensorStack
            out[name] = [_OBJECTS, list(value.tolist())]
    return out


def columns_in(wire: dict[str, list[Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (kind, value) in wire.items():
        if kind == _STRIDED:
            out[name] = torch.nested.as_nested_tensor(value, layout=torch.strided)
        elif kind == _OBJECTS:
            out[name] = objects(value)
        else:
            out[name] = value
    return out


def put_columns(columns: dict[str, Any]) -> dict[str, Any]:
    """A put's columns as the wire carries them: a nested tensor that is not jagged goes as
    its rows (the store keeps a nested column as rows either way)."""
    return {
        name: list(v.unbind())
        if isinstance(v, torch.Tensor) and v.is_nested and v.layout != torch.jagged
        else v
        for name, v in columns.items()
    }
