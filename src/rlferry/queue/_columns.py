"""Columns: the value of one field for many samples, row by row.

A field's value in a put is one column. Its kind is fixed by the first put of
the field in a partition and every batch returns the same kind:

- ``tensor``: a dense tensor, one row per sample (``shape[0]`` rows);
- ``nested``: a jagged nested tensor (``layout=torch.jagged``), one row per sample;
- ``ndarray``: a numpy array, one row per sample;
- ``list``: a Python list, one item per sample (strings, numbers, dicts, or tensors
  of different lengths: a ragged field).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from rlferry.wire import PackedStrings, RaggedRows, pack_strings, shared_copies, shared_empty
from rlferry.wire.lowlevel import PackedRows, bytes_copy, copy_many, materialized, tensor_refusal

from ._errors import SchemaError

__all__ = [
    "assemble",
    "kind_of",
    "nbytes",
    "packed_string_columns",
    "rows_of",
    "shared_columns",
    "shared_tensor_columns",
    "signature",
    "split_rows",
    "take",
]


def kind_of(field: str, value: Any) -> str:
    """The kind of a column, checked to travel (nothing of it is copied or encoded).

    Raises:
        SchemaError: a value the queue cannot store, naming the field and the fix.
    """
    if isinstance(value, torch.Tensor):
        why = tensor_refusal(value)
        if why is not None:
            raise SchemaError(f"field `{field}`: cannot travel: {why}")
        if value.is_nested:
            return "nested"
        if value.dim() == 0:
            raise SchemaError(
                f"field `{field}`: expected one row per sample, got a 0-d tensor "
                "(wrap a per-sample scalar in a 1-d tensor, one value per sample)"
            )
        return "tensor"
    if isinstance(value, (list, PackedStrings)):  # strings may come packed already
        return "list"
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        if value.dtype.kind not in "biufc" or value.dtype.fields is not None:
            raise SchemaError(
                f"field `{field}`: cannot travel: numpy dtype {value.dtype} "
                "(only bool, int, uint, float, complex; use a list for other values)"
            )
        if value.ndim == 0:
            raise SchemaError(
                f"field `{field}`: expected one row per sample, got a 0-d array "
                "(use a 1-d array, one value per sample)"
            )
        return "ndarray"
    raise SchemaError(
        f"field `{field}`: expected a tensor, a numpy array or a list with one row per sample, "
        f"got {type(value).__module__}.{type(value).__qualname__}"
    )


def rows_of(value: Any) -> int:
    return len(value) if isinstance(value, (list, PackedStrings, PackedRows)) else int(
        value.shape[0]
    )  # fmt: skip


def signature(kind: str, value: Any) -> list[Any]:
    """What must match between puts of one field: kind, dtype and row shape of dense kinds."""
    if kind == "tensor":
        return [kind, str(value.dtype).removeprefix("torch."), list(value.shape[1:])]
    if kind == "ndarray":
        return [kind, value.dtype.str, list(value.shape[1:])]
    if kind == "nested":
        return [kind, str(value.dtype).removeprefix("torch.")]
    return [kind]


def shared_columns(data: dict[str, Any]) -> dict[str, Any]:
    """The columns with their bulk in warm shared memory: the one copy a put makes, made
    early (while the controller places the put); over ipc:// nothing is copied again."""
    return {**data, **shared_tensor_columns(data), **packed_string_columns(data)}


def shared_tensor_columns(data: dict[str, Any]) -> dict[str, Any]:
    """The tensor columns that had to move into shared memory, moved (one segment)."""
    names, tensors = [], []
    for name, column in data.items():
        if isinstance(column, torch.Tensor):
            if not column.is_nested:
                names.append(name)
                tensors.append(column)
            elif getattr(column, "_lengths", None) is None and column._ragged_idx == 1:  # type: ignore[attr-defined]
                names.append(name)
                tensors.append(column.values())
    out = {}
    for name, before, after in zip(names, tensors, shared_copies(tensors), strict=True):
        if after is before:
            continue
        column = data[name]
        if column.is_nested:
            after = torch.nested.nested_tensor_from_jagged(after, column.offsets())
        out[name] = after
    return out


def packed_string_columns(data: dict[str, Any]) -> dict[str, Any]:
    """The long str/bytes list columns, packed into shared memory."""
    out = {}
    for name, column in data.items():
        if isinstance(column, list):
            packed = pack_strings(column)
            if packed is not None:
                out[name] = packed
    return out


def split_rows(value: Any, bounds: Sequence[int]) -> list[Any]:
    """Cut a column into consecutive row ranges (views, for every kind but lists)."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return [jagged_rows(value, a, b) for a, b in itertools.pairwise(bounds)]
    return [value[a:b] for a, b in itertools.pairwise(bounds)]


def jagged_rows(nt: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows ``[a, b)`` of a jagged nested tensor, as a view of its values."""
    offsets = nt.offsets()  # type: ignore[attr-defined]
    if a == 0 and b == offsets.numel() - 1:
        return nt
    o = offsets[a : b + 1]
    start, stop = int(o[0]), int(o[-1])
    return torch.nested.nested_tensor_from_jagged(nt.values()[start:stop], o - start)


def jagged_cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Jagged nested tensors one after another (one copy of the values)."""
    values = [p.values() for p in parts]
    rows = sum(v.shape[0] for v in values)
    out = shared_empty([rows, *values[0].shape[1:]], values[0].dtype)
    offsets, at, blocks = [torch.zeros(1, dtype=torch.int64)], 0, []
    for p, v in zip(parts, values, strict=True):
        offsets.append(p.offsets()[1:] + at)  # type: ignore[attr-defined]
        blocks.append((at, v))
        at += v.shape[0]
    _rows_into(out, blocks)
    return torch.nested.nested_tensor_from_jagged(out, torch.cat(offsets))


_TEXT = frozenset((str, bytes))


def nbytes(value: Any) -> int:
    """The payload bytes of a column or value (strings by their length)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            value = value.values()
        return value.numel() * value.element_size()
    if isinstance(value, list):
        if type(value) is RaggedRows and value.flat is not None:  # no row read
            return value.flat.numel() * value.flat.element_size()
        if set(map(type, value)) <= _TEXT:  # prompts, responses: at C speed (10x)
            return sum(map(len, value))
        return sum(nbytes(v) for v in value)
    if hasattr(value, "nbytes"):  # numpy arrays, PackedStrings
        return int(value.nbytes)
    if isinstance(value, (str, bytes)):
        return len(value)
    return 8


def take(pieces: Sequence[tuple[Any, int, int]]) -> Any:
    """Rows ``[a, b)`` of stored columns, in order: ``pieces`` is ``[(column, a, b), ...]``.

    One piece of a column comes back as a view (no copy), a ``TensorRef`` of a
    column held as one; more pieces of dense rows are gathered once into warm shared
    memory.
    """
    if len(pieces) == 1:
        col, a, b = pieces[0]
        if a == 0 and b == rows_of(col):
            return col
        if isinstance(col, torch.Tensor) and col.is_nested:
            return jagged_rows(col, a, b)
        return col[a:b]
    pieces = [(materialized(col), a, b) for col, a, b in pieces]  # a gather builds tensors
    first = pieces[0][0]
    if isinstance(first, torch.Tensor) and first.is_nested:
        nested = [jagged_rows(col, a, b) for col, a, b in pieces]
        return jagged_cat(nested)
    if all(isinstance(col, PackedStrings) for col, _, _ in pieces):
        return PackedStrings.concat([col[a:b] for col, a, b in pieces])
    if all(type(col) is PackedRows for col, _, _ in pieces) and (
        len({col.flat.dtype for col, _, _ in pieces}) == 1
    ):  # ragged tensors of one dtype, as a storage unit holds them
        return PackedRows.concat([col[a:b] for col, a, b in pieces])
    if isinstance(first, (list, PackedStrings, PackedRows)):  # small puts came as lists,
        return [  # large ones packed
            row
            for col, a, b in pieces
            for row in (col[a:b] if isinstance(col, list) else col[a:b].tolist())
        ]
    n = sum(b - a for _, a, b in pieces)
    out: Any
    if isinstance(first, torch.Tensor):
        out = shared_empty([n, *first.shape[1:]], first.dtype)
        return _rows_into(out, [(at, col[a:b]) for at, (col, a, b) in _starts(pieces)])
    import numpy as np

    out = np.empty((n, *first.shape[1:]), dtype=first.dtype)
    for at, (col, a, b) in _starts(pieces):
        out[at : at + b - a] = col[a:b]
    return out


def _starts(pieces: Sequence[tuple[Any, int, int]]) -> list[tuple[int, tuple[Any, int, int]]]:
    """Each piece with the row where it starts in their concatenation."""
    out, at = [], 0
    for piece in pieces:
        out.append((at, piece))
        at += piece[2] - piece[1]
    return out


def _rows_into(out: torch.Tensor, blocks: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Copy each ``(row, rows)`` block into ``out`` at that row: one large copy for all the
    contiguous blocks (streaming, on several threads), torch's copy for the others."""
    row_bytes = out[0].numel() * out.element_size() if out.shape[0] else 0
    jobs = []
    for row, rows in blocks:
        if bytes_copy(out, rows):
            jobs.append(
                (out.data_ptr() + row * row_bytes, rows.data_ptr(), rows.shape[0] * row_bytes)
            )
        else:
            out[row : row + rows.shape[0]] = rows
    copy_many(jobs)
    return out


def assemble(
    kind: str, parts: Sequence[tuple[Sequence[int], Any]], n: int, whole: bool = False
) -> Any:
    """Put per-storage-unit parts (``(positions in the batch, rows)``) into one column.

    ``whole``: the one part holds the batch in order; it is returned as it came (no copy).
    """
    value: Any
    if whole:
        value = parts[0][1]
    elif kind in ("list", "nested"):
        items: list[Any] = [None] * n
        for positions, rows in parts:
            if isinstance(rows, torch.Tensor):  # a jagged part: its rows
                rows = list(rows.unbind())
            for p, row in zip(positions, rows, strict=True):
                items[p] = row
        value = items
    else:
        first = parts[0][1]
        if isinstance(first, torch.Tensor):
            value = shared_empty([n, *first.shape[1:]], first.dtype)
            blocks = []
            for positions, rows in parts:
                a = positions[0]
                if list(positions) == list(range(a, a + len(positions))):
                    blocks.append((a, rows))  # a block of the batch: one copy
                else:
                    value.index_copy_(0, torch.as_tensor(positions, dtype=torch.long), rows)
            _rows_into(value, blocks)
        else:
            import numpy as np

            value = np.empty((n, *first.shape[1:]), dtype=first.dtype)
            for positions, rows in parts:
                value[list(positions)] = rows
    if kind == "nested" and not (isinstance(value, torch.Tensor) and value.is_nested):
        return _jagged(list(value))
    return value


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    """A jagged nested tensor of ``rows``: over their memory when they lie end to end in
    one buffer (as a ragged frame decodes), else over one copy."""
    first = rows[0]
    at = first.data_ptr()
    for t in rows:
        if t.data_ptr() != at or t.shape[1:] != first.shape[1:] or not t.is_contiguous():
            return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        at += t.numel() * t.element_size()
    lengths = torch.tensor([t.shape[0] for t in rows], dtype=torch.int64)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = torch.empty(0, dtype=first.dtype).set_(
        first.untyped_storage(), first.storage_offset(), (int(offsets[-1]), *first.shape[1:]), ()
    )
    return torch.nested.nested_tensor_from_jagged(values, offsets)
