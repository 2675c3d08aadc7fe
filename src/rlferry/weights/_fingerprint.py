"""A digest of named tensors: to check that an engine holds the trainer's weights bit for bit."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

__all__ = ["fingerprint"]


def fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over every ``(name, tensor)`` in order: the name, dtype, shape and bytes.
    Equal digests mean the same names hold the same bits (on any device)."""
    h = hashlib.sha256()
    for name, t in named_tensors:
        data = t.detach().contiguous().cpu()
        h.update(f"{name}|{str(data.dtype).removeprefix('torch.')}|{list(data.shape)}|".encode())
        h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()
