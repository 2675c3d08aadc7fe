"""``KVBatchMeta``: the metadata of the KV API (keys, one tag dict per key, fields)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ._extra import merge_extra

__all__ = ["KVBatchMeta", "kv_meta_owning"]


@dataclasses.dataclass
class KVBatchMeta:
    """The metadata of a KV batch: keys, one tag dict per key, partition, fields."""

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self)
        self.tags = copy.deepcopy(self.tags)
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return (
            f"KVBatchMeta(size={self.size}, field_names={self.fields}, "
            f"extra_info={self.extra_info})"
        )

    def select_keys(self, keys_to_select: list[str]) -> KVBatchMeta:
        if len(set(keys_to_select)) != len(keys_to_select):
            raise ValueError("keys_to_select: Contain duplicate keys (name each key once)")
        where = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in keys_to_select if k not in where]
        if missing:
            raise RuntimeError(f"Keys {missing} not found in current batch (it holds {self.keys})")
        return KVBatchMeta(
            keys=list(keys_to_select),
            tags=[self.tags[where[k]] for k in keys_to_select],
            partition_id=self.partition_id,
            fields=self.fields,
            extra_info=self.extra_info,
        )

    def reorder(self, indexes: list[int]) -> None:
        if len(indexes) != self.size:
            raise ValueError(
                f"reorder: indexes length {len(indexes)} does not match the batch size {self.size}"
            )
        if len(set(indexes)) != len(indexes):
            raise ValueError("reorder: Contain duplicate indexes (name each position once)")
        self.keys = [self.keys[i] for i in indexes]
        self.tags = [self.tags[i] for i in indexes]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            stop = start + base + (1 if i < extra else 0)
            out.append(
                KVBatchMeta(
                    keys=self.keys[start:stop],
                    tags=self.tags[start:stop],
                    partition_id=self.partition_id,
                    fields=self.fields,
                    extra_info=self.extra_info,
                )
            )
            start = stop
        return out

    @classmethod
    def concat(cls, data: list[KVBatchMeta]) -> KVBatchMeta:
        data = [c for c in data if c and c.size > 0]
        if not data:
            return cls()
        fields, partition = data[0].fields, data[0].partition_id
        for i, c in enumerate(data):
            if c.fields is not None and set(c.fields) != set(fields or ()):
                raise ValueError(
                    f"KVBatchMeta.concat: Field names do not match for concatenation: expected "
                    f"{fields} (as chunk[0]), got {c.fields} in chunk[{i}]"
                )
            if c.partition_id != partition:
                raise ValueError(
                    f"KVBatchMeta.concat: Partition do not match for concatenation: expected "
                    f"{partition!r} (as chunk[0]), got {c.partition_id!r} in chunk[{i}]"
                )
        extra = merge_extra([c.extra_info or {} for c in data], "KVBatchMeta")
        return cls(
            keys=[k for c in data for k in c.keys],
            tags=[t for c in data for t in c.tags],
            partition_id=partition,
            fields=fields,
            extra_info=extra or None,
        )


def kv_meta_owning(
    keys: list[str],
    tags: list[dict[str, Any]],
    partition_id: str | None,
    fields: list[str] | None,
    extra_info: dict[str, Any] | None,
) -> KVBatchMeta:
    """A ``KVBatchMeta`` that takes ``keys``, ``tags`` and ``extra_info`` as they are (its
    constructor deep-copies them): for values made for it alone.

    Raises:
        ValueError: tags not one per key, a key or a field twice.
    """
    out = KVBatchMeta.__new__(KVBatchMeta)
    out.keys, out.tags, out.partition_id = keys, tags, partition_id
    out.fields, out.extra_info = fields, extra_info
    _check(out)
    return out


def _check(meta: KVBatchMeta) -> None:
    if len(meta.keys) != len(meta.tags):
        raise ValueError(
            f"keys and tags must have same length, but got {len(meta.keys)} and "
            f"{len(meta.tags)} (give one tag dict per key, {{}} for none)"
        )
    if len(meta.keys) != len(set(meta.keys)):
        dup = sorted({k for k in meta.keys if meta.keys.count(k) > 1})
        raise ValueError(f"keys: Got duplicated keys {dup} (each key names one sample)")
    if meta.fields is not None and len(meta.fields) != len(set(meta.fields)):
        raise ValueError(f"fields: Got duplicated fields in {meta.fields}")
