"""A plan check of vLLM's worker against the checkpoint it serves (its tensors' shapes)."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable

from rlferry.errors import RequestError
from rlferry.weights.planning import TensorSpec

__all__ = ["checkpoint_check"]


def checkpoint_check(path: str) -> Callable[[list[TensorSpec]], None] | None:
    """A plan check against the shapes of the safetensors checkpoint in ``path`` (None if
    ``path`` holds none). Dtypes may differ (vLLM's loaders cast); names the checkpoint
    lacks go to the model's ``load_weights`` (which skips or refuses them)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else []
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, "pt") as h:
            for k in h.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                shapes[k] = tuple(int(d) for d in h.get_slice(k).get_shape())

    def check(specs: list[TensorSpec]) -> None:
        bad = [
            f"`{s.name}`: expected shape {list(want)}, got shape {list(s.shape)}"
            for s in specs
            if (want := shapes.get(s.name)) is not None and want != tuple(s.shape)
        ]
        if bad:
            more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise RequestError(
                f"{len(bad)} of {len(specs)} tensors differ from the checkpoint at {path}: "
                + "; ".join(bad[:3])
                + more
            )

    return check
