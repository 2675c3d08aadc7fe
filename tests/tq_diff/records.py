"""Plain, comparable records of what `transfer_queue` returns.

Every helper turns a TransferQueue result into JSON-able data (lists, dicts, strings, numbers)
so that a result from the real `transferqueue` package and one from rlferry's
`rlferry.compat.transferqueue` can be written to one golden file and compared field by field.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

RAISED_BY_TRANSFERQUEUE = (
    AssertionError,
    FileNotFoundError,
    IndexError,
    KeyError,
    NotImplementedError,
    RuntimeError,
    TypeError,
    ValueError,
)
"""The built-in exception types TransferQueue's API raises (and its users catch)."""


def error_name(exc: BaseException) -> str:
    """The built-in exception class a caller of TransferQueue catches `exc` by (`ValueError`,
    `RuntimeError`, ...).

    TransferQueue raises built-in exception types: one of those is recorded as it is. An
    implementation may raise a subclass with a clearer message (an rlferry error that is also
    a `RuntimeError`); callers catch the built-in type, so that is what has to match: the most
    specific of its built-in classes that TransferQueue raises (an rlferry error also belongs to
    rlferry's families: a `Timeout` is a `TimeoutError` too, which TransferQueue never raises).
    """
    if type(exc).__module__ == "builtins":
        return type(exc).__name__
    builtin = [cls for cls in type(exc).__mro__ if cls.__module__ == "builtins"]
    for cls in builtin:
        if cls in RAISED_BY_TRANSFERQUEUE:
            return cls.__name__
    return builtin[0].__name__ if builtin else type(exc).__name__


def outcome(fn: Callable[[], Any], convert: Callable[[Any], Any] | None = None) -> dict:
    """`{"returned": convert(result)}`, or `{"raised": <built-in exception type>}`.

    Without `convert`, a TensorDict is recorded by `tensordict`, other values as they are.
    """
    try:
        value = fn()
    except Exception as exc:
        return {"raised": error_name(exc)}
    if convert is not None:
        return {"returned": convert(value)}
    if hasattr(value, "batch_size") and hasattr(value, "keys"):
        return {"returned": tensordict(value)}
    return {"returned": value}


def rows(value: Any) -> list:
    """The samples of a batched column, one entry per sample.

    A tensor column is unbound along the batch dimension, so a stacked tensor and a jagged
    (nested) tensor holding the same samples give the same record: TransferQueue 0.1.11 returns
    a fixed-shape field either stacked or as a jagged nested tensor, depending on how the samples
    were spread over its storage units (its own tests accept either).
    """
    if isinstance(value, torch.Tensor):
        return [sample.tolist() for sample in value.unbind(0)]
    if hasattr(value, "tolist"):
        return list(value.tolist())
    return list(value)


def tensordict(td: Any) -> dict:
    """Batch size and, per field (sorted), dtype and per-sample values of a TensorDict."""
    fields: dict[str, Any] = {}
    for name in sorted(td.keys()):
        value = td.get(name)
        if isinstance(value, torch.Tensor):
            fields[name] = {"dtype": str(value.dtype).removeprefix("torch."), "rows": rows(value)}
        else:
            fields[name] = {"non_tensor": rows(value)}
    return {"batch_size": list(td.batch_size), "fields": fields}


def batch_meta(meta: Any) -> dict:
    """The public state of a `BatchMeta`."""
    return {
        "size": meta.size,
        "len": len(meta),
        "global_indexes": [int(i) for i in meta.global_indexes],
        "partition_ids": list(meta.partition_ids),
        "field_names": list(meta.field_names),
        "is_ready": bool(meta.is_ready),
        "custom_meta": [dict(entry) for entry in meta.get_all_custom_meta()],
        "extra_info": dict(meta.get_all_extra_info()),
    }


def field_types(meta: Any) -> dict:
    """Per field of a `BatchMeta`: its per-sample dtypes and shapes (None: not a tensor)."""
    return {
        name: {
            "dtypes": [
                None if d is None else str(d).removeprefix("torch.") for d in meta.get_dtypes(name)
            ],
            "shapes": [None if s is None else list(s) for s in meta.get_shapes(name)],
        }
        for name in meta.field_names
    }


def kv_meta(meta: Any) -> dict:
    """The public state of a `KVBatchMeta`."""
    return {
        "size": meta.size,
        "len": len(meta),
        "keys": list(meta.keys),
        "tags": [dict(tag) for tag in meta.tags],
        "partition_id": meta.partition_id,
        "fields": None if meta.fields is None else list(meta.fields),
        "extra_info": None if meta.extra_info is None else dict(meta.extra_info),
    }


def status(pair: tuple[Any, Any]) -> dict:
    """A `(global_index, status)` pair from `get_consumption_status`/`get_production_status`."""
    index, flags = pair
    return {
        "global_index": None if index is None else torch.as_tensor(index).to(torch.int64).tolist(),
        "status": None if flags is None else torch.as_tensor(flags).to(torch.int64).tolist(),
    }


@contextlib.contextmanager
def running(tq: Any, conf: Any = None) -> Iterator[Any]:
    """`tq.init(conf)`, the client, and `tq.close()` at the end whatever happens."""
    tq.init(conf)
    try:
        yield tq.get_client()
    finally:
        tq.close()
