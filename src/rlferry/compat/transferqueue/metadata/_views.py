"""Per-sample read-only views of a ``BatchMeta`` (``batch.samples[i]``), made on demand."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from types import MappingProxyType
from typing import Any

__all__ = ["SampleViews"]

Locate = Callable[[int], tuple[int, str]]
"""Position in the batch -> (global index, partition id)."""


class _SampleView:
    """A read-only view of one sample of a ``BatchMeta`` (made on demand)."""

    __slots__ = ("_batch", "_i", "_locate")

    def __init__(self, batch: Any, i: int, locate: Locate) -> None:
        self._batch = batch
        self._i = i
        self._locate = locate

    @property
    def global_index(self) -> int:
        return self._locate(self._i)[0]

    @property
    def partition_id(self) -> str:
        return self._locate(self._i)[1]

    @property
    def production_status(self) -> int:
        return int(self._batch.production_status[self._i])

    @property
    def custom_meta(self) -> MappingProxyType[str, Any]:
        return MappingProxyType(self._batch.custom_meta[self._i])

    @property
    def fields(self) -> MappingProxyType[str, MappingProxyType[str, Any]]:
        out: dict[str, MappingProxyType[str, Any]] = {}
        for name, meta in self._batch.field_schema.items():
            one = {k: v for k, v in meta.items() if k != "per_sample_shapes"}
            shapes = meta.get("per_sample_shapes")
            if shapes is not None:
                one["shape"] = shapes[self._i]
            out[name] = MappingProxyType(one)
        return MappingProxyType(out)

    def __repr__(self) -> str:
        return (
            f"_SampleView(global_index={self.global_index}, partition_id={self.partition_id!r}, "
            f"production_status={self.production_status}, "
            f"fields={list(self._batch.field_schema)})"
        )


class SampleViews(Sequence[_SampleView]):
    """The samples of ``batch`` as views; ``locate`` answers a position's global index and
    partition (the batch's own arrays, read when a view is read)."""

    __slots__ = ("_batch", "_locate")

    def __init__(self, batch: Any, locate: Locate) -> None:
        self._batch = batch
        self._locate = locate

    def __len__(self) -> int:
        return self._batch.size

    def __getitem__(self, i: Any) -> Any:
        if not -self._batch.size <= i < self._batch.size:
            raise IndexError(f"sample {i}: expected an index in [0, {self._batch.size})")
        return _SampleView(self._batch, i % self._batch.size, self._locate)

    def __iter__(self) -> Iterator[_SampleView]:
        return (_SampleView(self._batch, i, self._locate) for i in range(self._batch.size))
