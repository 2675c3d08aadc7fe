"""The controller's and the store's state as plain values (what the wire carries) and back,
and the checkpoint files that hold them.

A checkpoint file is rlferry's checked format (:mod:`rlferry.wire.files`): nothing in it is
pickled, so reading one runs no code. Partitions become dicts of arrays, a field's dtype
its name, and a dict whose keys are not all str (a sampler's caches, custom meta by global
index) a list of ``(key, value)`` pairs under one reserved key. A file that TransferQueue
wrote (a ``torch.save`` pickle of its objects) is read only when the caller says it trusts
it (``trust_pickle=True``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlferry.wire.files import FileFormatError, read_file

from ._partition import Field, Partition

__all__ = [
    "CONTROLLER_FILE",
    "PICKLED_CONTROLLER_FILE",
    "PICKLED_STORAGE_FILE",
    "STORAGE_FILE",
    "controller_in",
    "controller_out",
    "plain",
    "read_saved",
    "store_in",
    "store_out",
    "unplain",
]

CONTROLLER_FILE = "controller_state.rlf"
STORAGE_FILE = "storage.rlf"
PICKLED_CONTROLLER_FILE = "controller_state.pt"  # TransferQueue's own names
PICKLED_STORAGE_FILE = "storage.pt"

_ITEMS = "__rlferry_items__"  # a dict with keys other than str: its (key, value) pairs


def plain(value: Any) -> Any:
    """``value`` with every dict whose keys are not all str turned into ``{_ITEMS: pairs}``
    and numpy scalars into Python numbers, so that the wire carries it."""
    if isinstance(value, dict):
        if all(type(k) is str for k in value):
            return {k: plain(v) for k, v in value.items()}
        return {_ITEMS: [(plain(k), plain(v)) for k, v in value.items()]}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def unplain(value: Any) -> Any:
    """The value :func:`plain` was given."""
    if isinstance(value, dict):
        if len(value) == 1 and _ITEMS in value:
            return {unplain(k): unplain(v) for k, v in value[_ITEMS]}
        return {k: unplain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unplain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(unplain(v) for v in value)
    return value


def _dtype(name: str | None) -> Any:
    if name is None:
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"field dtype: expected a torch dtype's name, got {name!r}")
    return dtype


def _shape(shape: Any) -> list[int] | None:
    return None if shape is None else [int(d) for d in shape]


def _field_out(f: Field) -> dict[str, Any]:
    return {
        "dtype": None if f.dtype is None else str(f.dtype),
        "shape": _shape(f.shape),
        "is_nested": f.is_nested,
        "is_non_tensor": f.is_non_tensor,
        "shapes": [(i, list(s)) for i, s in f.shapes.items()],
    }


def _field_in(saved: dict[str, Any]) -> Field:
    f = Field()
    f.dtype = _dtype(saved["dtype"])
    f.shape = None if saved["shape"] is None else torch.Size(saved["shape"])
    f.is_nested, f.is_non_tensor = saved["is_nested"], saved["is_non_tensor"]
    f.shapes = {int(i): tuple(s) for i, s in saved["shapes"]}
    return f


def _partition_out(p: Partition) -> dict[str, Any]:
    return {
        "id": p.id,
        "members": p.members,
        "pre": list(p.pre),
        "produced": dict(p.produced),
        "consumed": dict(p.consumed),
        "fields": {name: _field_out(f) for name, f in p.fields.items()},
        "custom": [(i, plain(c)) for i, c in p.custom.items()],
        "keys": dict(p.keys),
    }


def _partition_in(saved: dict[str, Any]) -> Partition:
    p = Partition(saved["id"])
    p.members = saved["members"]
    p.pre = list(saved["pre"])
    p.produced = dict(saved["produced"])
    p.consumed = dict(saved["consumed"])
    p.fields = {name: _field_in(f) for name, f in saved["fields"].items()}
    p.custom = {int(i): unplain(c) for i, c in saved["custom"]}
    p.set_keys(dict(saved["keys"]))
    return p


def controller_out(state: dict[str, Any]) -> dict[str, Any]:
    """The controller's ``state()`` as plain values."""
    return {
        "parts": {pid: _partition_out(p) for pid, p in state["parts"].items()},
        "next": state["next"],
        "free": list(state["free"]),
        "sampler": plain(state["sampler"]),
    }


def controller_in(saved: dict[str, Any]) -> dict[str, Any]:
    """The controller's ``state()`` that :func:`controller_out` was given."""
    return {
        "parts": {pid: _partition_in(p) for pid, p in saved["parts"].items()},
        "next": int(saved["next"]),
        "free": [np.asarray(a, dtype=np.int64) for a in saved["free"]],
        "sampler": unplain(saved["sampler"]),
    }


def store_out(state: dict[str, Any]) -> dict[str, Any]:
    """The store's ``state()`` as plain values (its chunks' values made plain)."""
    return {
        pid: {name: {**s, "chunks": plain(s["chunks"])} for name, s in cols.items()}
        for pid, cols in state.items()
    }


def store_in(saved: dict[str, Any]) -> dict[str, Any]:
    """The store's ``state()`` that :func:`store_out` was given."""
    return {
        pid: {
            name: {
                **s,
                "chunks": unplain(s["chunks"]),
                "kinds": list(s["kinds"]),
                "live": list(s["live"]),
            }
            for name, s in cols.items()
        }
        for pid, cols in saved.items()
    }


def read_saved(path: str, trust_pickle: bool) -> tuple[Any, bool]:
    """``(state, pickled)``: the state in the local file ``path``; ``pickled`` when it was
    a pickle (TransferQueue's own format), read only with ``trust_pickle``.

    Raises:
        FileFormatError: the file is not whole, or is a pickle and ``trust_pickle`` is
            False (the message names the keyword).
    """
    try:
        return read_file(path), False
    except FileFormatError as e:
        if not e.looks_like or e.looks_like.startswith("a numpy"):
            raise
        if not trust_pickle:
            raise FileFormatError(
                f"{path}: {e.looks_like} (TransferQueue's own checkpoint format), which can "
                "run code when loaded: refused; load_checkpoint(..., trust_pickle=True) "
                "reads it if you trust the file",
                looks_like=e.looks_like,
            ) from None
    return torch.load(path, weights_only=False), True
