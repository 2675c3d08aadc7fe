"""What a delta push's ``Setup`` tells each receiver: the base version, and for each tensor
sent sparse its name, shape, dtype and changed elements (its bytes are the tensor pushed
under its :func:`~._record.parts_name`; a tensor sent dense is pushed under its own name)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import WeightSyncError
from ..planning._buckets import Plan
from ..planning._specs import TensorSpec, dtype_from_name, dtype_name
from ._record import SUFFIX, layout

__all__ = ["DeltaHeader"]

Sparse = tuple[str, tuple[int, ...], torch.dtype, int]


@dataclass(frozen=True)
class DeltaHeader:
    base: int
    sparse: tuple[Sparse, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "base": self.base,
            "sparse": [[n, list(s), dtype_name(d), c] for n, s, d, c in self.sparse],
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> DeltaHeader:
        try:
            sparse = tuple(
                (str(n), tuple(int(x) for x in s), dtype_from_name(str(dt)), int(c))
                for n, s, dt, c in d["sparse"]
            )
            return cls(int(d["base"]), sparse)
        except (KeyError, TypeError, ValueError):
            raise WeightSyncError("malformed delta header") from None

    def specs(self, plan: Plan) -> list[TensorSpec]:
        """The tensors the push updates, as the receiver's parameters see them: the plan's,
        each sparse tensor's bytes replaced by the tensor itself. Raises
        ``WeightSyncError`` if the plan does not carry the bytes the header announces."""
        sparse = {n + SUFFIX: (n, s, dt, c) for n, s, dt, c in self.sparse}
        out = []
        for spec in plan.specs:
            entry = sparse.pop(spec.name, None)
            if entry is None:
                if spec.name.endswith(SUFFIX):
                    raise WeightSyncError(f"malformed delta: `{spec.name}` is not announced")
                out.append(spec)
                continue
            name, shape, dtype, changed = entry
            numel = 1
            for x in shape:
                numel *= x
            nbytes = layout(numel, changed, dtype.itemsize)[3]
            if spec.dtype != torch.uint8 or spec.shape != (nbytes,):
                raise WeightSyncError(
                    f"malformed delta: `{name}` with {changed} changed elements takes "
                    f"{nbytes} bytes, the plan has {spec.describe()}"
                )
            out.append(TensorSpec(name, shape, dtype))
        if sparse:
            raise WeightSyncError(
                f"malformed delta: `{next(iter(sparse.values()))[0]}` is announced, not pushed"
            )
        return out
