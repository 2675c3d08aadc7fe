"""A batch's field schema: per field its dtype, per-sample shape, nested or not, tensor or not.

``extract_field_schema`` reads it from a TensorDict; the rest keeps the per-sample shapes of
nested fields in step with a batch's samples when it is cut, reordered or concatenated.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_concat", "concat_schema", "extract_field_schema", "pick_shapes"]

Schema = dict[str, dict[str, Any]]


def extract_field_schema(data: Any) -> Schema:
    """The field schema of a TensorDict: dtype, per-sample shape, nested, non-tensor."""
    schema: Schema = {}
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


def pick_shapes(schema: Schema, order: list[int]) -> None:
    """Keep, in place, the per-sample shapes of the samples at positions ``order``."""
    for meta in schema.values():
        shapes = meta.get("per_sample_shapes")
        if shapes is not None:
            meta["per_sample_shapes"] = [shapes[i] for i in order]


def check_concat(schemas: list[Schema]) -> None:
    """Chunks of one concat must have the same fields, of the same dtypes."""
    base = sorted(schemas[0])
    for i, schema in enumerate(schemas):
        names = sorted(schema)
        if names != base:
            raise ValueError(
                f"BatchMeta.concat: field_names mismatch at chunk[{i}]: expected {base}, "
                f"got {names} (extra in chunk: {set(names) - set(base)}, "
                f"missing from chunk: {set(base) - set(names)})"
            )
    for name in base:
        dtype = schemas[0][name].get("dtype")
        for i, schema in enumerate(schemas[1:], start=1):
            if schema[name].get("dtype") != dtype:
                raise ValueError(
                    f"Field '{name}' dtype mismatch in concat: expected {dtype} (as "
                    f"chunk[0]), got {schema[name].get('dtype')} in chunk[{i}]"
                )


def concat_schema(schemas: list[Schema], sizes: list[int]) -> Schema:
    """The schema of the chunks' samples in order (``sizes``: each chunk's sample count): a
    field nested in any chunk is nested, with every sample's shape."""
    out: Schema = {}
    for name, meta in schemas[0].items():
        metas = [s.get(name, {}) for s in schemas]
        nested = any(m.get("is_nested", False) for m in metas)
        one = {
            "dtype": meta.get("dtype"),
            "shape": None if nested else meta.get("shape"),
            "is_nested": nested,
            "is_non_tensor": meta.get("is_non_tensor", False),
        }
        if nested or any(m.get("per_sample_shapes") for m in metas):
            shapes: list[Any] = []
            for size, m in zip(sizes, metas, strict=True):
                shapes.extend(m.get("per_sample_shapes") or [m.get("shape")] * size)
            one["per_sample_shapes"] = shapes
        out[name] = one
    return out
