"""Large CPU buffers that are used again: a put copies into one, a get copies out into one.

A first touch of fresh memory costs more than the copy itself on a virtual machine (a page
fault per 4 KiB). Buffers of 4 MiB and more are therefore kept once nobody uses them: the
pool lends numpy arrays (numpy asks for huge pages for large arrays) wrapped as tensors, and
takes one back when only the pool still refers to it (CPython's reference count: a tensor,
or any view of it, that is still alive keeps its array referenced). A training loop whose
steps move the same shapes then copies into warm memory. At most ``limit`` bytes wait unused.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

__all__ = ["Pool"]

_LARGE = 4 << 20  # bytes: smaller tensors come from torch's allocator


class Pool:
    def __init__(self, limit: int = 2 << 30) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._lent: list[np.ndarray] = []
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor (its memory possibly used before)."""
        n = 1
        for d in shape:
            n *= int(d)
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        if nbytes < _LARGE:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            self._reclaim()
            spare = self._free.get(nbytes)
            if spare:
                buf = spare.pop()
                self._free_bytes -= nbytes
            else:
                buf = np.empty(nbytes, dtype=np.uint8)
            self._lent.append(buf)
        return torch.from_numpy(buf).view(dtype).view(shape)

    def _reclaim(self) -> None:
        """Take back the buffers no tensor refers to any more (lock held)."""
        still = []
        for buf in self._lent:
            # referenced by: the list, the loop variable, getrefcount's argument
            if sys.getrefcount(buf) > 3:
                still.append(buf)
            elif self._free_bytes + buf.nbytes <= self.limit:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._free_bytes += buf.nbytes
        self._lent = still
