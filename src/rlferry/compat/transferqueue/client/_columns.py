"""A TensorDict's columns as a put hands them to the store, and a get's columns back as the
rows of a batch: a tensor (dense or nested) or a list of one value per sample."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..state import pack

__all__ = ["column", "empty_tensordict", "parsed", "rows_of", "scatter", "tensordict_of"]


def tensordict_of(data: Any) -> Any:
    from tensordict import TensorDict

    if not isinstance(data, TensorDict):
        raise TypeError(
            f"data: expected a TensorDict with batch_size=[n], got {type(data).__name__} "
            "(wrap columns as TensorDict({...}, batch_size=n))"
        )
    return data


def empty_tensordict() -> Any:
    from tensordict import TensorDict

    return TensorDict({}, batch_size=0)


def column(data: Any, name: str, n: int) -> Any:
    """One field of a TensorDict: a tensor (dense or nested), or a list of ``n`` values (a
    NonTensorData of one value stands for that value in every row)."""
    value = data.get(name)
    if isinstance(value, torch.Tensor):
        return value
    items = data[name]
    if isinstance(items, (str, bytes)) or not hasattr(items, "__len__") or len(items) != n:
        return [items] * n
    return list(items)


def parsed(columns: dict[str, Any], parser: Callable[[Any], Any]) -> dict[str, Any]:
    """TransferQueue's ``data_parser``: it edits a dict of batched values in place (tensors as
    they are, nested tensors and non-tensor columns as lists)."""
    plain = {
        k: (list(v.unbind()) if isinstance(v, torch.Tensor) and v.is_nested else v)
        for k, v in columns.items()
    }
    parser(plain)
    return plain


def rows_of(columns: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, v in columns.items():
        if isinstance(v, torch.Tensor) and not v.is_nested:
            out[name] = v[torch.from_numpy(rows)]
        else:
            items = list(v.unbind()) if isinstance(v, torch.Tensor) else v
            out[name] = [items[i] for i in rows.tolist()]
    return out


def scatter(pieces: list[tuple[np.ndarray | None, Any]], n: int) -> Any:
    """One column of a batch that spans partitions, from each partition's rows."""
    values: list[Any] = [None] * n
    for rows, p in pieces:
        items = list(p.unbind()) if isinstance(p, torch.Tensor) else list(p.tolist())
        for r, v in zip(rows.tolist() if rows is not None else range(n), items, strict=True):
            values[r] = v
    return pack(values)
