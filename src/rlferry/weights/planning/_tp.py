"""A tensor-parallel engine's layout, as vLLM lays out Llama-, Qwen- and DeepSeek-like models.

From the trainer's (Hugging Face) names and full shapes, each of ``tp`` ranks gets:

- column-parallel (split on dim 0, ``torch.chunk`` bounds): ``q_b_proj``, ``kv_b_proj``,
  vocab-parallel ``embed_tokens`` and ``lm_head``; fused: ``qkv_proj`` = its slices of
  ``q_proj``, ``k_proj``, ``v_proj`` one after the other (weights and biases), and
  ``gate_up_proj`` = its slices of ``gate_proj`` and ``up_proj``;
- row-parallel (split on dim 1): ``o_proj``, ``down_proj``;
- fused experts (transformers' ``experts.gate_up_proj`` [E, 2I, H] and
  ``experts.down_proj`` [E, H, I]): ``experts.w13_weight`` [E, 2I/tp, H] (its gate
  rows, then its up rows) and ``experts.w2_weight`` [E, H, I/tp];
- everything else (norms, routers, biases of row-parallel layers) whole on every rank.

In block FP8 (``dtype="fp8_block128"``) the weights of linear layers are kept as
``float8_e4m3fn`` with their ``<name>_scale_inv`` (vLLM's block-FP8 linear layers): each
rank's slice, and each member of a fused parameter, must be whole 128 x 128 blocks, as
vLLM requires too.

Replicas (data-parallel engines) repeat the same ranks. Vocabulary padding and kv
heads fewer than ``tp`` (replicated by vLLM) are not modelled: the slices are exact.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlferry.errors import RequestError

from ._blocks import BLOCK_FP8, FP8, QUANTIZE, check_engine_dtype, quantized_by_default
from ._boxes import Box, chunk_bounds, full_box
from ._layouts import EngineDtype, EngineLayout, ParamLayout, Part
from ._specs import TensorSpec

__all__ = ["tp_layout"]

_COLUMN = ("q_b_proj", "kv_b_proj", "embed_tokens", "lm_head")
_ROW = ("o_proj", "down_proj")
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip


def _split(box: Box, dim: int, tp: int, rank: int) -> Box:
    b = list(box)
    lo, hi = b[dim]
    a, z = chunk_bounds(hi - lo, tp, rank)
    b[dim] = (lo + a, lo + z)
    return tuple(b)


def tp_layout(
    specs: Iterable[TensorSpec],
    tp: int,
    *,
    replicas: int = 1,
    dtype: EngineDtype | None = None,
) -> EngineLayout:
    """The layout of ``replicas`` engines of ``tp`` ranks each (receiver ``i * tp + r`` is
    rank ``r`` of engine ``i``); ``dtype``: the engine's (default: each tensor's own;
    ``"fp8_block128"``: the weights of linear layers in block FP8, with their scales, the
    others in their own dtype; a slice that is not whole 128 x 128 blocks is a
    ``BlockFP8Error``)."""
    check_engine_dtype(dtype, "tp_layout.dtype")
    if type(tp) is not int or tp < 1:
        raise RequestError(f"tp_layout.tp: expected an int >= 1, got {tp!r}")
    if type(replicas) is not int or replicas < 1:
        raise RequestError(f"tp_layout.replicas: expected an int >= 1, got {replicas!r}")
    specs = tuple(specs)
    ranks = [_rank(specs, tp, r, dtype) for r in range(tp)]
    return EngineLayout(specs, tuple(ranks) * replicas)


def _rank(
    specs: tuple[TensorSpec, ...], tp: int, r: int, dtype: EngineDtype | None
) -> tuple[ParamLayout, ...]:
    params: dict[str, list[Part]] = {}
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, torch.dtype] = {}
    block: set[str] = set()  # the parameters kept in block FP8

    def add(name: str, source: TensorSpec, box: Box, at_dim: int) -> None:
        """Append ``box`` of ``source`` to ``name`` along ``at_dim`` (after what it holds)."""
        ext = [b - a for a, b in box]
        shape = shapes.get(name)
        if shape is None:
            shape = shapes[name] = [0 if d == at_dim else e for d, e in enumerate(ext)]
        at = [(0, e) for e in ext]
        start = shape[at_dim]
        at[at_dim] = (start, start + ext[at_dim])
        shape[at_dim] += ext[at_dim]
        params.setdefault(name, []).append(Part(source.name, box, tuple(at)))
        if dtype == BLOCK_FP8:
            if quantized_by_default(source.name, source.shape):
                block.add(name)
            dtypes[name] = FP8 if name in block else source.dtype
        else:
            dtypes[name] = dtype if isinstance(dtype, torch.dtype) else source.dtype

    fused: dict[str, list[tuple[int, TensorSpec]]] = {}
    for s in specs:
        parts = s.name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        whole = full_box(s.shape)
        if (
            len(parts) >= 3
            and parts[-2] == "experts"
            and parts[-1] == "gate_up_proj"
            and len(s.shape) == 3
        ):
            half = s.shape[1] // 2
            for k in range(2):  # gate rows, then up rows, each split
                box = _split(
                    ((0, s.shape[0]), (k * half, (k + 1) * half), (0, s.shape[2])), 1, tp, r
                )
                add(".".join([*parts[:-1], "w13_weight"]), s, box, 1)
        elif (
            len(parts) >= 3
            and parts[-2] == "experts"
            and parts[-1] == "down_proj"
            and len(s.shape) == 3
        ):
            add(".".join([*parts[:-1], "w2_weight"]), s, _split(whole, 2, tp, r), 2)
        elif module in _FUSED and s.shape:
            fused.setdefault(".".join([*parts[:-2], _FUSED[module][0], parts[-1]]), []).append(
                (_FUSED[module][1], s)
            )
        elif module in _COLUMN and s.shape:
            add(s.name, s, _split(whole, 0, tp, r), 0)
        elif module in _ROW and len(s.shape) == 2:
            add(s.name, s, _split(whole, 1, tp, r), 1)
        else:
            add(s.name, s, whole, 0) if s.shape else _scalar(params, shapes, dtypes, s, dtype)
    for name, members in fused.items():
        for _, s in sorted(members, key=lambda m: m[0]):
            add(name, s, _split(full_box(s.shape), 0, tp, r), 0)
    return tuple(
        ParamLayout(n, tuple(shapes[n]), dtypes[n], tuple(ps), QUANTIZE if n in block else None)
        for n, ps in params.items()
    )


def _scalar(
    params: dict[str, list[Part]],
    shapes: dict[str, list[int]],
    dtypes: dict[str, torch.dtype],
    s: TensorSpec,
    dtype: EngineDtype | None,
) -> None:
    params[s.name] = [Part(s.name, (), ())]
    shapes[s.name] = []
    dtypes[s.name] = dtype if isinstance(dtype, torch.dtype) else s.dtype


def tp_split_dim(spec: TensorSpec) -> int | None:
    """The dimension a tensor-parallel layer splits ``spec`` on (as :func:`tp_layout` does;
    for a fused experts tensor, that of its parts), or None when it is replicated."""
    parts = spec.name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module == "experts" and len(spec.shape) == 3:
        return {"gate_up_proj": 1, "down_proj": 2}.get(parts[-1])
    if not spec.shape:
        return None
    if module in _FUSED or module in _COLUMN:
        return 0
    if module in _ROW and len(spec.shape) == 2:
        return 1
    return None
