"""A batch's ``extra_info``: the batch-level dict that ``concat`` merges across chunks."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

__all__ = ["merge_extra"]

log = logging.getLogger("rlferry.compat.transferqueue")


def _equal(a: Any, b: Any) -> bool:
    """Equality of two ``extra_info`` values (tensors and arrays compared by value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # an object whose == cannot answer: treat as different
        return False


def merge_extra(infos: list[dict[str, Any]], what: str) -> dict[str, Any]:
    """Union of the chunks' ``extra_info``; a key with two values is refused."""
    merged: dict[str, Any] = {}
    if any(set(i) != set(infos[0]) for i in infos[1:]):
        log.warning("%s.concat: extra_info key sets differ across chunks; taking their union", what)
    for n, info in enumerate(infos):
        for key, value in info.items():
            if key in merged and not _equal(merged[key], value):
                raise ValueError(
                    f"{what}.concat: extra_info key '{key}' has conflicting values across "
                    f"chunks and cannot be merged: expected {merged[key]!r} (as chunk[0]), got "
                    f"{value!r} in chunk[{n}] (give every chunk the same value, or drop the key)"
                )
            merged.setdefault(key, value)
    return merged
