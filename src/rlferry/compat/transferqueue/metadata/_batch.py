"""``BatchMeta``: TransferQueue's metadata of a batch of samples, held as arrays.

A ``BatchMeta`` names samples by global index (its ``Samples``: arrays, see
``_samples.py``), and holds the batch's field schema and ``extra_info``. The public
attributes read as TransferQueue's do (``global_indexes`` is a list of ints,
``partition_ids`` a list of strings, ``custom_meta`` a list of dicts).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._extra import merge_extra
from ._samples import Samples, one_or_each, writable
from ._schema import check_concat, concat_schema, extract_field_schema, pick_shapes
from ._views import SampleViews

__all__ = ["BatchMeta", "from_arrays", "samples_of"]

log = logging.getLogger("rlferry.compat.transferqueue")


def _check_len(what: str, got: int, n: int) -> None:
    if got != n:
        raise ValueError(f"{what} length {got} != batch_size {n}: expected one entry per sample")


class BatchMeta:
    """Metadata of a batch of samples: global indexes, partitions, field schema,
    production status, batch-level ``extra_info`` and per-sample ``custom_meta``.

    Picklable (frameworks broadcast it with ``torch.distributed.broadcast_object_list``).
    """

    __slots__ = ("_samples", "extra_info", "field_schema", "production_status")

    def __init__(
        self,
        global_indexes: Sequence[int] | np.ndarray,
        partition_ids: Sequence[str] | str,
        field_schema: dict[str, dict[str, Any]] | None = None,
        production_status: np.ndarray | Sequence[int] | None = None,
        extra_info: dict[str, Any] | None = None,
        custom_meta: list[dict[str, Any]] | None = None,
        _custom_backend_meta: list[dict[str, Any]] | None = None,
    ) -> None:
        gi = np.array(global_indexes, dtype=np.int64).reshape(-1)
        n = len(gi)
        if isinstance(partition_ids, str):
            pids: str | list[str] = partition_ids
        else:
            listed = list(partition_ids)
            if len(listed) != n:
                raise ValueError(
                    f"Length mismatch: global_indexes has {n}, partition_ids has {len(listed)} "
                    "(give one partition id per sample)"
                )
            pids = one_or_each(listed)
        self.field_schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        for name, meta in self.field_schema.items():
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = list(meta["per_sample_shapes"])
                _check_len(f"Field '{name}' per_sample_shapes", len(meta["per_sample_shapes"]), n)
        if production_status is None:
            self.production_status = np.zeros(n, dtype=np.int8)
        else:
            self.production_status = np.array(production_status, dtype=np.int8).reshape(-1)
            _check_len("production_status", len(self.production_status), n)
        self.extra_info = dict(extra_info or {})
        self._samples = Samples(gi, pids)
        if custom_meta:
            _check_len("custom_meta", len(custom_meta), n)
            self._samples.custom = [dict(d) for d in custom_meta]
        if _custom_backend_meta:
            _check_len("_custom_backend_meta", len(_custom_backend_meta), n)
            self._samples.backend = [dict(d) for d in _custom_backend_meta]

    @classmethod
    def _of(
        cls,
        samples: Samples,
        schema: dict[str, dict[str, Any]],
        status: np.ndarray,
        extra_info: dict[str, Any] | None = None,
    ) -> BatchMeta:
        """A batch of samples already checked (no per-sample work)."""
        b = cls.__new__(cls)
        b._samples = samples
        b.field_schema = schema
        b.production_status = status
        b.extra_info = extra_info if extra_info is not None else {}
        return b

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, s) for s in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for slot, value in zip(self.__slots__, state, strict=True):
            setattr(self, slot, writable(value))

    # ---- the attributes TransferQueue users read ----
    @property
    def global_indexes(self) -> list[int]:
        return list(self._samples.indexes.tolist())

    @global_indexes.setter
    def global_indexes(self, value: Sequence[int]) -> None:
        self._samples.indexes = np.array(value, dtype=np.int64).reshape(-1)

    @property
    def partition_ids(self) -> list[str]:
        return self._samples.partition_ids()

    @partition_ids.setter
    def partition_ids(self, value: Sequence[str]) -> None:
        self._samples.partition = one_or_each(list(value))

    @property
    def custom_meta(self) -> list[dict[str, Any]]:
        return self._samples.custom_list()

    @custom_meta.setter
    def custom_meta(self, value: list[dict[str, Any]]) -> None:
        self._samples.custom = list(value)

    @property
    def _custom_backend_meta(self) -> list[dict[str, Any]]:
        return self._samples.backend_list()

    @_custom_backend_meta.setter
    def _custom_backend_meta(self, value: list[dict[str, Any]]) -> None:
        self._samples.backend = list(value)

    @property
    def size(self) -> int:
        return len(self._samples)

    @property
    def field_names(self) -> list[str]:
        return sorted(self.field_schema)

    @property
    def samples(self) -> SampleViews:
        return SampleViews(self, self._samples.locate)

    @property
    def is_ready(self) -> bool:
        return self.size > 0 and bool(np.all(self.production_status == 1))

    def __len__(self) -> int:
        return len(self._samples)

    def get_dtypes(self, field_name: str) -> list[Any]:
        if field_name not in self.field_schema:
            raise KeyError(f"Field '{field_name}' not found in field_schema")
        return [self.field_schema[field_name].get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list[Any]:
        if field_name not in self.field_schema:
            raise KeyError(f"Field '{field_name}' not found in field_schema")
        meta = self.field_schema[field_name]
        shapes = meta.get("per_sample_shapes")
        return list(shapes) if shapes is not None else [meta.get("shape")] * self.size

    # ---- extra info (batch level) ----
    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict[str, Any]:
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info_dict: dict[str, Any]) -> None:
        self.extra_info.update(info_dict)

    def remove_extra_info(self, key: str) -> Any:
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        self.extra_info.clear()

    def has_extra_info(self, key: str) -> bool:
        return key in self.extra_info

    # ---- custom meta (per sample) ----
    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: list[dict[str, Any]] | None) -> None:
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise ValueError(
                f"custom_meta: expected {self.size} dicts (one per sample), got "
                f"{len(custom_meta)} (The length of custom_meta list {len(custom_meta)} must "
                f"match the batch size: {self.size})"
            )
        for mine, theirs in zip(self.custom_meta, custom_meta, strict=True):
            mine.update(theirs)

    def clear_custom_meta(self) -> None:
        self._samples.custom = None

    # ---- operations ----
    def add_fields(self, tensor_dict: Any, set_all_ready: bool = True) -> BatchMeta:
        """Add the fields of ``tensor_dict`` (in place); every sample becomes ready by default."""
        n = tensor_dict.batch_size[0]
        if n == 0:
            return self
        if n != self.size:
            raise ValueError(
                f"add_fields: expected a TensorDict of {self.size} rows (this batch's size), "
                f"got {n} (add_fields batch size mismatch)"
            )
        self.field_schema.update(extract_field_schema(tensor_dict))
        if set_all_ready:
            self.production_status[:] = 1
        return self

    def _take(self, rows: np.ndarray) -> BatchMeta:
        """The samples at positions ``rows`` (already checked), metadata copied."""
        schema = copy.deepcopy(self.field_schema)
        pick_shapes(schema, rows.tolist())
        status = self.production_status[rows]
        return BatchMeta._of(self._samples.take(rows), schema, status, dict(self.extra_info))

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        rows = np.asarray(sample_indices, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.size):
            raise ValueError(
                f"sample_indices: expected positions in range [0, {self.size}), got "
                f"{rows[(rows < 0) | (rows >= self.size)].tolist()} (Sample indices must be in "
                f"range [0, {self.size}))"
            )
        return self._take(rows)

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        schema = {
            f: copy.deepcopy(self.field_schema[f]) for f in field_names if f in self.field_schema
        }
        samples = self._samples.with_fields(set(field_names))
        status = self.production_status.copy()
        return BatchMeta._of(samples, schema, status, copy.deepcopy(self.extra_info))

    def copy(self) -> BatchMeta:
        return self._take(np.arange(self.size))

    def __getitem__(self, item: Any) -> BatchMeta:
        if isinstance(item, (int, np.integer)):
            i = int(item) + (self.size if item < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError(
                    f"BatchMeta index out of range: expected an index in [-{self.size}, "
                    f"{self.size}), got {item}"
                )
            return self._take(np.array([i]))
        if isinstance(item, slice):
            return self._take(np.arange(self.size)[item])
        raise TypeError(
            f"Indexing with {type(item)} is not supported: expected an int or a slice "
            "(use select_samples for a list of positions)"
        )

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """Split into ``chunks`` parts, the first ``size % chunks`` one sample longer."""
        if self.size < chunks:
            log.warning(
                "BatchMeta.chunk: %d chunks of %d samples: some chunks are empty", chunks, self.size
            )
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            stop = start + base + (1 if i < extra else 0)
            out.append(self._take(np.arange(start, stop)))
            start = stop
        return out

    def chunk_by_partition(self) -> list[BatchMeta]:
        if isinstance(self._samples.partition, str):
            return [self.copy()] if self.size else []
        return [self._take(rows) for _, _, rows in self._samples.groups() if rows is not None]

    def union(self, other: BatchMeta | None) -> BatchMeta:
        """This batch's fields and ``other``'s (``other`` wins on a name) for the same samples."""
        if not other or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if not np.array_equal(self._samples.indexes, other._samples.indexes):
            raise ValueError(
                "BatchMeta.union: global_indexes do not match: expected the same samples in "
                f"the same order, got self.global_indexes={self.global_indexes}, "
                f"other.global_indexes={other.global_indexes} (reorder one side first)"
            )
        if self.partition_ids != other.partition_ids:
            raise ValueError(
                "BatchMeta.union: partition_ids do not match: "
                f"self.partition_ids={self.partition_ids}, "
                f"other.partition_ids={other.partition_ids}"
            )
        out = self.copy()
        out.field_schema.update(copy.deepcopy(other.field_schema))
        out.production_status = np.bitwise_and(self.production_status, other.production_status)
        out.extra_info = {**self.extra_info, **other.extra_info}
        out._samples.update_dicts(other._samples)
        return out

    @classmethod
    def concat(cls, data: list[BatchMeta], validate: bool = True) -> BatchMeta:
        """One batch of the chunks' samples in order; empty chunks are skipped."""
        data = [c for c in data if c and c.size > 0]
        if not data:
            return cls.empty()
        schemas = [c.field_schema for c in data]
        if validate:
            check_concat(schemas)
        return cls._of(
            Samples.concat([c._samples for c in data]),
            concat_schema(schemas, [c.size for c in data]),
            np.concatenate([c.production_status for c in data]),
            merge_extra([c.extra_info for c in data], "BatchMeta"),
        )

    def reorder(self, indices: Sequence[int]) -> None:
        """Put the samples in the order ``indices`` (positions in this batch), in place."""
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(rows) != self.size:
            raise ValueError(
                f"reorder: expected {self.size} positions (Indices length {len(rows)} mismatch "
                f"batch size {self.size})"
            )
        if rows.size and (rows.min() < 0 or rows.max() >= self.size):
            raise ValueError(f"Reorder indices must be in range [0, {self.size})")
        if (np.bincount(rows, minlength=self.size) != 1).any():
            raise ValueError("reorder: expected each position once (Indices contain duplicates)")
        self._samples.reorder(rows)
        self.production_status = self.production_status[rows]
        pick_shapes(self.field_schema, rows.tolist())

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        samples = Samples(np.zeros(0, dtype=np.int64), [])
        return cls._of(samples, {}, np.zeros(0, dtype=np.int8), dict(extra_info or {}))

    def __str__(self) -> str:
        return (
            f"BatchMeta(size={self.size}, field_names={self.field_names}, "
            f"is_ready={self.is_ready}, global_indexes={self.global_indexes}, "
            f"extra_info={self.extra_info})"
        )

    __repr__ = __str__


def from_arrays(
    indexes: np.ndarray,
    partition: str | list[str],
    schema: dict[str, dict[str, Any]],
    status: np.ndarray,
    custom: list[dict[str, Any]] | None = None,
) -> BatchMeta:
    """A batch from arrays already checked (no per-sample work): global indexes (int64),
    one partition id or one per sample, the schema, production status (int8), custom meta."""
    return BatchMeta._of(Samples(indexes, partition, custom), schema, status)


def samples_of(meta: BatchMeta) -> Samples:
    """The samples a batch names, as it holds them (not a copy)."""
    return meta._samples
