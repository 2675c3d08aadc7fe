"""A field's values as TransferQueue returns them: tensors as one jagged nested tensor (or
the column itself, one scalar per sample), anything else a ``NonTensorStack``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["nested", "objects", "pack"]


def nested(dense: torch.Tensor) -> torch.Tensor:
    """Rows of a dense tensor as TransferQueue returns tensor fields: a jagged nested tensor
    (its rows' first dimension ragged), or the column itself for one scalar per sample."""
    if dense.dim() == 1:
        return dense
    n, first = dense.shape[0], dense.shape[1]
    if n == 0 or first == 0:
        return torch.nested.as_nested_tensor(list(dense.unbind()), layout=torch.jagged)
    offsets = torch.arange(n + 1, dtype=torch.int64) * first
    values = dense.contiguous().reshape(n * first, *dense.shape[2:])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def objects(values: list[Any]) -> Any:
    """Values that are not tensors, one per sample, as one ``NonTensorStack``."""
    from tensordict import NonTensorStack

    return NonTensorStack(*values)


def pack(values: list[Any]) -> Any:
    """Values of one field, as TransferQueue packs them: tensors as one jagged nested tensor
    (strided when jagged cannot hold them; scalars stacked), anything else a NonTensorStack."""
    if values and all(isinstance(v, torch.Tensor) for v in values):
        if all(v.dim() == 0 for v in values):
            return torch.stack(values)
        for layout in (torch.jagged, torch.strided):
            try:
                return torch.nested.as_nested_tensor(values, layout=layout)
            except (RuntimeError, TypeError):
                continue  # rows this layout cannot hold: try the next
    return objects(values)
