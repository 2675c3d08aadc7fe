"""Layouts: what each trainer rank owns and what each engine rank needs, as boxes.

A :class:`TrainerLayout` says, per trainer rank, which box of each full tensor
it holds (FSDP2 rows, a DTensor's shard); every byte has one owner (a tensor
replicated on several ranks is owned by one, chosen so that the ranks' bytes
stay even). An :class:`EngineLayout` says, per engine rank, what each of its
parameters is made of: parts, each a box of a source tensor and where it goes in
the parameter (a tensor-parallel slice, a fused ``qkv_proj``), and the
parameter's dtype. Both are plain data, fingerprinted: the plan is recomputed
only when a fingerprint changes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlferry.errors import RequestError

from .._errors import BlockFP8Error
from ._blocks import (
    BLOCK_FP8,
    FP8,
    QUANTIZE,
    block_box,
    check_aligned,
    check_engine_dtype,
    quantized_by_default,
    scale_name,
    scale_shape,
)
from ._boxes import Box, box_str, check_box, chunk_bounds, extents, full_box, volume
from ._specs import TensorSpec, dtype_name, specs_of

__all__ = [
    "EngineDtype",
    "EngineLayout",
    "ParamLayout",
    "Part",
    "TrainerLayout",
    "dtensor_layout",
    "fsdp_layout",
]


EngineDtype = torch.dtype | str  # a torch dtype, or "fp8_block128" (block FP8)


def _digest(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class TrainerLayout:
    """Per trainer rank, the box of each full tensor it owns (tensors it owns nothing
    of are left out). Boxes of one tensor must not overlap (the plan checks that
    every needed byte has exactly one owner)."""

    specs: tuple[TensorSpec, ...]
    owned: tuple[Mapping[str, Box], ...]
    fingerprint: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {s.name: s for s in self.specs}
        if len(by_name) != len(self.specs):
            raise RequestError("TrainerLayout.specs: expected unique names, got a name twice")
        if not self.owned:
            raise RequestError("TrainerLayout.owned: expected at least one rank, got none")
        owned = []
        for r, boxes in enumerate(self.owned):
            mine = {}
            for name, box in boxes.items():
                spec = by_name.get(name)
                if spec is None:
                    raise RequestError(
                        f"TrainerLayout.owned[{r}][{name!r}]: expected a tensor of specs, got an "
                        "unknown name (give the spec of every tensor a rank owns)"
                    )
                b = check_box(box, spec.shape, f"TrainerLayout.owned[{r}][{name!r}]")
                if volume(b) or not spec.nbytes:
                    mine[name] = b
            owned.append(mine)
        object.__setattr__(self, "owned", tuple(owned))
        lines = [f"{s.name}{list(s.shape)}{dtype_name(s.dtype)}" for s in self.specs]
        for r, boxes in enumerate(self.owned):
            lines += [f"{r}:{n}{box_str(b)}" for n, b in boxes.items()]
        object.__setattr__(self, "fingerprint", _digest(lines))

    @property
    def ranks(self) -> int:
        return len(self.owned)

    def owned_bytes(self, rank: int) -> int:
        """Bytes of the full tensors that ``rank`` owns."""
        sp = {s.name: s for s in self.specs}
        return sum(volume(b) * sp[n].dtype.itemsize for n, b in self.owned[rank].items())

    @classmethod
    def single(cls, specs: Iterable[TensorSpec]) -> TrainerLayout:
        """One rank owns every tensor whole: today's single sender."""
        specs = tuple(specs)
        return cls(specs, ({s.name: full_box(s.shape) for s in specs},))


def _least_loaded(load: list[int], ranks: Iterable[int]) -> int:
    """Of ``ranks``, the one with the fewest bytes so far (the lowest on a tie)."""
    return min(ranks, key=lambda i: (load[i], i))


def fsdp_layout(specs: Iterable[TensorSpec], ranks: int, *, dim: int = 0) -> TrainerLayout:
    """FSDP2 ``fully_shard`` over ``ranks``: each tensor split on ``dim`` as ``torch.chunk``;
    a 0-d tensor (it cannot be split) is owned whole by the rank with the fewest bytes."""
    if type(ranks) is not int or ranks < 1:
        raise RequestError(f"fsdp_layout.ranks: expected an int >= 1, got {ranks!r}")
    specs = tuple(specs)
    owned: list[dict[str, Box]] = [{} for _ in range(ranks)]
    load = [0] * ranks
    for s in specs:
        if not s.shape:
            r = _least_loaded(load, range(ranks))
            owned[r][s.name] = ()
            load[r] += s.nbytes
            continue
        if not 0 <= dim < len(s.shape):
            raise RequestError(
                f"fsdp_layout.dim: expected a dimension of `{s.name}` {list(s.shape)}, got {dim}"
            )
        for r in range(ranks):
            lo, hi = chunk_bounds(s.shape[dim], ranks, r)
            box = (*full_box(s.shape)[:dim], (lo, hi), *full_box(s.shape)[dim + 1 :])
            if hi > lo:
                owned[r][s.name] = box
                load[r] += volume(box) * s.dtype.itemsize
    return TrainerLayout(specs, tuple(owned))


def dtensor_layout(named: Iterable[tuple[str, Any]], ranks: int | None = None) -> TrainerLayout:
    """The layout of a state dict of DTensors (and plain tensors), on every rank alike.

    Each DTensor's placements over its mesh give every rank's box: ``Shard(d)`` splits
    dimension ``d`` as ``torch.chunk`` (placements in mesh order, as DTensor does);
    ``Replicate`` leaves it whole, and of the ranks that hold the same box one owns it
    (the one with the fewest bytes so far, so the bytes stay even). A plain tensor is
    replicated on every rank. ``Partial`` and strided shards are not boxes: refused.
    ``ranks``: the trainer's world size (default: the first DTensor's mesh's).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    items = list(named)
    if ranks is None:
        meshes = [t.device_mesh for _, t in items if isinstance(t, DTensor)]
        ranks = meshes[0].size() if meshes else 1
    specs = tuple(specs_of(items))
    owned: list[dict[str, Box]] = [{} for _ in range(ranks)]
    load = [0] * ranks
    for (name, t), spec in zip(items, specs, strict=True):
        holders: dict[Box, list[int]] = {}
        if isinstance(t, DTensor):
            mesh_ranks = t.device_mesh.mesh
            for coord in _coords(tuple(mesh_ranks.shape)):
                cut = list(full_box(spec.shape))
                for mdim, p in enumerate(t.placements):
                    if type(p) is Shard:
                        lo, hi = cut[p.dim]
                        a, b = chunk_bounds(hi - lo, mesh_ranks.shape[mdim], coord[mdim])
                        cut[p.dim] = (lo + a, lo + b)
                    elif not isinstance(p, Replicate):
                        raise RequestError(
                            f"tensor `{name}`: expected Shard(d) or Replicate placements, got "
                            f"{p!r} (not a box of the full tensor: a Partial needs a reduction; "
                            "give its full_tensor() or an explicit TrainerLayout)"
                        )
                holders.setdefault(tuple(cut), []).append(int(mesh_ranks[coord]))
        else:
            holders[full_box(spec.shape)] = list(range(ranks))
        for box, rs in holders.items():
            if volume(box) == 0 and spec.shape:
                continue
            if any(r >= ranks for r in rs):
                raise RequestError(
                    f"tensor `{name}`: its mesh holds rank {max(rs)}, expected ranks below "
                    f"{ranks} (give ranks= the trainer's world size)"
                )
            r = _least_loaded(load, rs)
            owned[r][name] = box
            load[r] += volume(box) * spec.dtype.itemsize
    return TrainerLayout(specs, tuple(owned))


def _coords(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [(*c, i) for c in out for i in range(n)]
    return out


@dataclass(frozen=True)
class Part:
    """Box ``box`` of source tensor ``source`` goes to box ``at`` of an engine parameter.
    ``at`` has the same extents, or leading extents of 1 more (an expert's matrix in a
    stacked ``experts.w13_weight``)."""

    source: str
    box: Box
    at: Box


@dataclass(frozen=True)
class ParamLayout:
    """One engine parameter: its name, shape, dtype and the parts it is made of (disjoint;
    rows they leave out, vocabulary padding say, are never written).

    ``quantize="block128"``: the engine keeps it in block FP8 (``dtype``
    ``float8_e4m3fn``, at least 2-D), with its float32 scales in a parameter of its own,
    ``<name>_scale_inv`` (one per 128 x 128 block of the last two dims; see
    :data:`~rlferry.weights.planning.BLOCK_FP8`); each part must be whole blocks of its
    source and of the parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[Part, ...]
    quantize: str | None = None


@dataclass(frozen=True)
class EngineLayout:
    """Per engine rank (receiver), its parameters. ``specs``: the full source tensors
    (the trainer's names, shapes and dtypes) the parts refer to."""

    specs: tuple[TensorSpec, ...]
    receivers: tuple[tuple[ParamLayout, ...], ...]
    fingerprint: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {s.name: s for s in self.specs}
        if not self.receivers:
            raise RequestError("EngineLayout.receivers: expected at least one receiver, got none")
        lines = [f"{s.name}{list(s.shape)}{dtype_name(s.dtype)}" for s in self.specs]
        for r, params in enumerate(self.receivers):
            names = set()
            for p in params:
                where = f"EngineLayout.receivers[{r}][{p.name!r}]"
                if p.name in names:
                    raise RequestError(f"{where}: expected unique parameter names, got it twice")
                names.add(p.name)
                lines.append(f"{r}:{p.name}{list(p.shape)}{dtype_name(p.dtype)}")
                _check_parts(p, by_name, where)
                if p.quantize is not None:
                    _check_block_fp8(p, by_name, where)
                    if scale_name(p.name) in names:
                        raise RequestError(
                            f"{where}: its scales' name `{scale_name(p.name)}` is another "
                            "parameter's (expected unique parameter names)"
                        )
                    names.add(scale_name(p.name))
                    lines.append(f"{r}:{p.name}:{p.quantize}")
                lines += [f"{q.source}{box_str(q.box)}>{box_str(q.at)}" for q in p.parts]
        object.__setattr__(self, "fingerprint", _digest(lines))

    @classmethod
    def whole(
        cls,
        specs: Iterable[TensorSpec],
        receivers: int = 1,
        dtype: EngineDtype | Mapping[str, EngineDtype] | None = None,
    ) -> EngineLayout:
        """Each receiver needs every tensor whole, under its own name (today's receivers;
        ``dtype``: the engine's, one for every tensor or by name, default the trainer's;
        ``"fp8_block128"`` keeps a tensor in block FP8: given for every tensor, the weights
        of linear layers, the others in the trainer's dtype; given by name, that tensor)."""
        specs = tuple(specs)
        params = []
        for s in specs:
            d = dtype.get(s.name) if isinstance(dtype, Mapping) else dtype
            check_engine_dtype(d, "EngineLayout.whole.dtype")
            block = d == BLOCK_FP8 and (
                isinstance(dtype, Mapping) or quantized_by_default(s.name, s.shape)
            )
            whole = (Part(s.name, full_box(s.shape), full_box(s.shape)),)
            if block:
                params.append(ParamLayout(s.name, s.shape, FP8, whole, QUANTIZE))
            else:
                kept = d if isinstance(d, torch.dtype) else s.dtype
                params.append(ParamLayout(s.name, s.shape, kept, whole))
        return cls(specs, (tuple(params),) * receivers)

    def param_specs(self, receiver: int) -> dict[str, TensorSpec]:
        """What receiver ``receiver`` must hold: each parameter's name, shape and dtype (a
        block-FP8 one's scales too, as ``<name>_scale_inv``)."""
        out = {}
        for p in self.receivers[receiver]:
            out[p.name] = TensorSpec(p.name, p.shape, p.dtype)
            if p.quantize is not None:
                n = scale_name(p.name)
                out[n] = TensorSpec(n, scale_shape(p.shape), torch.float32)
        return out

    def needed_bytes(self, receiver: int) -> int:
        """Bytes receiver ``receiver`` takes per update (a block-FP8 part's scales too)."""
        return sum(
            volume(q.box) * p.dtype.itemsize
            + (volume(block_box(q.box)) * 4 if p.quantize is not None else 0)
            for p in self.receivers[receiver]
            for q in p.parts
        )


def _check_parts(p: ParamLayout, specs: Mapping[str, TensorSpec], where: str) -> None:
    seen: list[Box] = []
    for i, q in enumerate(p.parts):
        spec = specs.get(q.source)
        if spec is None:
            raise RequestError(
                f"{where}.parts[{i}].source: expected a tensor of the specs, got {q.source!r} "
                "(the engine layout names the trainer's tensors)"
            )
        box = check_box(q.box, spec.shape, f"{where}.parts[{i}].box")
        at = check_box(q.at, p.shape, f"{where}.parts[{i}].at")
        e, ea = extents(box), extents(at)
        if ea[len(ea) - len(e) :] != e or any(x != 1 for x in ea[: len(ea) - len(e)]):
            raise RequestError(
                f"{where}.parts[{i}]: expected `at` of the extents of `box` {list(e)}, got "
                f"{list(ea)} (a part is copied as it is, never reshaped)"
            )
        for j, other in enumerate(seen):
            if _overlap(other, at):
                raise RequestError(
                    f"{where}.parts[{i}].at: expected parts that do not overlap, got "
                    f"{box_str(at)} over parts[{j}] {box_str(other)} (each byte of a "
                    "parameter comes from one part)"
                )
        seen.append(at)
    if not math.prod(p.shape) and p.parts:
        raise RequestError(f"{where}: an empty parameter has no parts")


def _check_block_fp8(p: ParamLayout, specs: Mapping[str, TensorSpec], where: str) -> None:
    if p.quantize != QUANTIZE or p.dtype != FP8 or len(p.shape) < 2:
        raise BlockFP8Error(
            f"{where}: expected block FP8 as quantize={QUANTIZE!r} of a float8_e4m3fn "
            f"parameter of 2 dims or more, got quantize={p.quantize!r} of "
            f"{dtype_name(p.dtype)} {list(p.shape)} (norms, biases and embeddings stay "
            "unquantized)"
        )
    for i, q in enumerate(p.parts):
        fix = "an engine whose slices are whole blocks: fewer TP ranks, or this tensor unquantized"
        check_aligned(q.box, specs[q.source].shape, f"{where}.parts[{i}].box", fix)
        check_aligned(q.at, p.shape, f"{where}.parts[{i}].at", fix)


def _overlap(a: Box, b: Box) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
