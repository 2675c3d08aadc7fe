"""``BatchMeta`` and ``KVBatchMeta``: TransferQueue's metadata types, held as arrays.

A ``BatchMeta`` names samples by global index. Here the indexes are one int64
numpy array, the partition of a batch is one string while all its samples share
it, and per-sample dicts (``custom_meta``) exist only once a caller reads or
sets them: a batch of 100k samples is a handful of Python objects, not 100k.
The public attributes read as TransferQueue's do (``global_indexes`` is a list
of ints, ``partition_ids`` a list of strings, ``custom_meta`` a list of dicts).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ._views import SampleViews

__all__ = ["BatchMeta", "extract_field_schema", "merge_extra"]

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


def extract_field_schema(data: Any) -> dict[str, dict[str, Any]]:
    """The field schema of a TensorDict: dtype, per-sample shape, nested, non-tensor."""
    schema: dict[str, dict[str, Any]] = {}
    n = data.batch_size[0] if len(data.batch_size) else 0
    if n == 0:
        return schema
    for name, value in data.items():
        tensor = isinstance(value, torch.Tensor)
        nested = tensor and value.is_nested
        if nested:
            rows = value.unbind()
            if len(rows) != n:
                raise ValueError(
                    f"field '{name}': expected {n} rows (the TensorDict's batch_size), got a "
                    f"nested tensor of {len(rows)} (Inconsistent batch dimension)"
                )
            shapes = [tuple(r.shape) for r in rows]
            schema[name] = {
                "dtype": value.dtype,
                "shape": None,
                "is_nested": True,
                "is_non_tensor": False,
                "per_sample_shapes": shapes,
            }
        elif tensor:
            shape = tuple(value.shape[1:]) if value.dim() > 1 else (1,)
            schema[name] = {
                "dtype": value.dtype,
                "shape": torch.Size(shape),
                "is_nested": False,
                "is_non_tensor": False,
            }
        else:
            schema[name] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    return schema


def _check_len(what: str, got: int, n: int) -> None:
    if got != n:
        raise ValueError(f"{what} length {got} != batch_size {n}: expected one entry per sample")


class BatchMeta:
    """Metadata of a batch of samples: global indexes, partitions, field schema,
    production status, batch-level ``extra_info`` and per-sample ``custom_meta``.

    Picklable (frameworks broadcast it with ``torch.distributed.broadcast_object_list``).
    """

    __slots__ = (
        "_backend",
        "_custom",
        "_gi",
        "_pids",
        "extra_info",
        "field_schema",
        "production_status",
    )

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
        self._gi = np.array(global_indexes, dtype=np.int64).reshape(-1)
        n = len(self._gi)
        if isinstance(partition_ids, str):
            self._pids: str | list[str] = partition_ids
        else:
            pids = list(partition_ids)
            if len(pids) != n:
                raise ValueError(
                    f"Length mismatch: global_indexes has {n}, partition_ids has {len(pids)} "
                    "(give one partition id per sample)"
                )
            self._pids = pids[0] if pids and pids.count(pids[0]) == n else pids
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
        self._custom: list[dict[str, Any]] | None = None
        if custom_meta:
            _check_len("custom_meta", len(custom_meta), n)
            self._custom = [dict(d) for d in custom_meta]
        self._backend: list[dict[str, Any]] | None = None
        if _custom_backend_meta:
            _check_len("_custom_backend_meta", len(_custom_backend_meta), n)
            self._backend = [dict(d) for d in _custom_backend_meta]

    @classmethod
    def _of(
        cls,
        indexes: np.ndarray,
        partition: str | list[str],
        schema: dict[str, dict[str, Any]],
        status: np.ndarray,
        custom: list[dict[str, Any]] | None = None,
        extra_info: dict[str, Any] | None = None,
    ) -> BatchMeta:
        """A batch from arrays already checked (no per-sample work)."""
        b = cls.__new__(cls)
        b._gi = indexes
        b._pids = partition
        b.field_schema = schema
        b.production_status = status
        b.extra_info = extra_info if extra_info is not None else {}
        b._custom = custom
        b._backend = None
        return b

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, s) for s in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for slot, value in zip(self.__slots__, state, strict=True):
            if isinstance(value, np.ndarray) and not value.flags.writeable:
                value = value.copy()  # arrays deserialized zero-copy are read-only
            setattr(self, slot, value)

    # ---- the attributes TransferQueue users read ----
    @property
    def global_indexes(self) -> list[int]:
        return list(self._gi.tolist())

    @global_indexes.setter
    def global_indexes(self, value: Sequence[int]) -> None:
        self._gi = np.array(value, dtype=np.int64).reshape(-1)

    @property
    def partition_ids(self) -> list[str]:
        if isinstance(self._pids, str):
            return [self._pids] * len(self._gi)
        return list(self._pids)

    @partition_ids.setter
    def partition_ids(self, value: Sequence[str]) -> None:
        pids = list(value)
        self._pids = pids[0] if pids and pids.count(pids[0]) == len(pids) else pids

    def _pid_at(self, i: int) -> str:
        return self._pids if isinstance(self._pids, str) else self._pids[i]

    @property
    def custom_meta(self) -> list[dict[str, Any]]:
        if self._custom is None:
            self._custom = [{} for _ in range(len(self._gi))]
        return self._custom

    @custom_meta.setter
    def custom_meta(self, value: list[dict[str, Any]]) -> None:
        self._custom = list(value)

    @property
    def _custom_backend_meta(self) -> list[dict[str, Any]]:
        if self._backend is None:
            self._backend = [{} for _ in range(len(self._gi))]
        return self._backend

    @_custom_backend_meta.setter
    def _custom_backend_meta(self, value: list[dict[str, Any]]) -> None:
        self._backend = list(value)

    @property
    def size(self) -> int:
        return len(self._gi)

    @property
    def field_names(self) -> list[str]:
        return sorted(self.field_schema)

    @property
    def samples(self) -> SampleViews:
        return SampleViews(self)

    @property
    def is_ready(self) -> bool:
        return len(self._gi) > 0 and bool(np.all(self.production_status == 1))

    def __len__(self) -> int:
        return len(self._gi)

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
        self._custom = None

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
        for meta in schema.values():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None:
                meta["per_sample_shapes"] = [shapes[i] for i in rows.tolist()]
        pids = self._pids if isinstance(self._pids, str) else [self._pids[i] for i in rows]
        b = BatchMeta._of(
            self._gi[rows],
            pids,
            schema,
            self.production_status[rows],
            extra_info=dict(self.extra_info),
        )
        if self._custom is not None:
            b._custom = [copy.deepcopy(self._custom[i]) for i in rows.tolist()]
        if self._backend is not None:
            b._backend = [copy.deepcopy(self._backend[i]) for i in rows.tolist()]
        return b

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
        wanted = set(field_names)
        schema = {
            f: copy.deepcopy(self.field_schema[f]) for f in field_names if f in self.field_schema
        }
        b = BatchMeta._of(
            self._gi.copy(),
            self._pids if isinstance(self._pids, str) else list(self._pids),
            schema,
            self.production_status.copy(),
            extra_info=copy.deepcopy(self.extra_info),
        )
        if self._custom is not None:
            b._custom = copy.deepcopy(self._custom)
        if self._backend is not None:
            b._backend = [
                {f: v for f, v in m.items() if f.startswith("_") or f in wanted}
                for m in self._backend
            ]
        return b

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
        if isinstance(self._pids, str):
            return [self.copy()] if self.size else []
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(self._pids):
            groups.setdefault(p, []).append(i)
        return [self._take(np.array(rows)) for rows in groups.values()]

    def union(self, other: BatchMeta | None) -> BatchMeta:
        """This batch's fields and ``other``'s (``other`` wins on a name) for the same samples."""
        if not other or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if not np.array_equal(self._gi, other._gi):
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
        if other._custom is not None:
            for mine, theirs in zip(out.custom_meta, other._custom, strict=True):
                mine.update(copy.deepcopy(theirs))
        if other._backend is not None:
            for mine, theirs in zip(out._custom_backend_meta, other._backend, strict=True):
                mine.update(copy.deepcopy(theirs))
        return out

    @classmethod
    def concat(cls, data: list[BatchMeta], validate: bool = True) -> BatchMeta:
        """One batch of the chunks' samples in order; empty chunks are skipped."""
        data = [c for c in data if c and c.size > 0]
        if not data:
            return cls.empty()
        if validate:
            base = data[0].field_names
            for i, c in enumerate(data):
                if c.field_names != base:
                    raise ValueError(
                        f"BatchMeta.concat: field_names mismatch at chunk[{i}]: expected {base}, "
                        f"got {c.field_names} (extra in chunk: {set(c.field_names) - set(base)}, "
                        f"missing from chunk: {set(base) - set(c.field_names)})"
                    )
            for name in base:
                dtype = data[0].field_schema[name].get("dtype")
                for i, c in enumerate(data[1:], start=1):
                    if c.field_schema[name].get("dtype") != dtype:
                        raise ValueError(
                            f"Field '{name}' dtype mismatch in concat: expected {dtype} (as "
                            f"chunk[0]), got {c.field_schema[name].get('dtype')} in chunk[{i}]"
                        )
        schema: dict[str, dict[str, Any]] = {}
        for name, meta in data[0].field_schema.items():
            metas = [c.field_schema.get(name, {}) for c in data]
            nested = any(m.get("is_nested", False) for m in metas)
            one = {
                "dtype": meta.get("dtype"),
                "shape": None if nested else meta.get("shape"),
                "is_nested": nested,
                "is_non_tensor": meta.get("is_non_tensor", False),
            }
            if nested or any(m.get("per_sample_shapes") for m in metas):
                shapes: list[Any] = []
                for c, m in zip(data, metas, strict=True):
                    shapes.extend(m.get("per_sample_shapes") or [m.get("shape")] * c.size)
                one["per_sample_shapes"] = shapes
            schema[name] = one
        pids: str | list[str]
        if all(isinstance(c._pids, str) and c._pids == data[0]._pids for c in data):
            pids = data[0]._pids
        else:
            pids = [p for c in data for p in c.partition_ids]
        b = cls._of(
            np.concatenate([c._gi for c in data]),
            pids,
            schema,
            np.concatenate([c.production_status for c in data]),
            extra_info=merge_extra([c.extra_info for c in data], "BatchMeta"),
        )
        if any(c._custom is not None for c in data):
            b._custom = [m for c in data for m in c.custom_meta]
        if any(c._backend is not None for c in data):
            b._backend = [m for c in data for m in c._custom_backend_meta]
        return b

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
        self._gi = self._gi[rows]
        if not isinstance(self._pids, str):
            self._pids = [self._pids[i] for i in rows]
        self.production_status = self.production_status[rows]
        order = rows.tolist()
        for meta in self.field_schema.values():
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in order]
        if self._custom is not None:
            self._custom = [self._custom[i] for i in order]
        if self._backend is not None:
            self._backend = [self._backend[i] for i in order]

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        return cls._of(
            np.zeros(0, dtype=np.int64),
            [],
            {},
            np.zeros(0, dtype=np.int8),
            extra_info=dict(extra_info or {}),
        )

    def __str__(self) -> str:
        return (
            f"BatchMeta(size={self.size}, field_names={self.field_names}, "
            f"is_ready={self.is_ready}, global_indexes={self.global_indexes}, "
            f"extra_info={self.extra_info})"
        )

    __repr__ = __str__
