"""Block FP8 as the plan sees it: which tensors, which blocks, and where their scales go.

An engine that keeps a weight in block FP8 holds two tensors for it, as DeepSeek-V3 and
Kimi-K2 checkpoints and vLLM's block-FP8 linear layers do: the weight as
``float8_e4m3fn`` (its own shape) and ``<name>_scale_inv``, one float32 per 128 x 128
block of its last two dimensions (``[..., ceil(rows / 128), ceil(cols / 128)]``;
leading dimensions, a stack of experts, kept). A parameter laid out so
(``ParamLayout.quantize == "block128"``) is made of parts whose blocks are blocks of the
full source tensor: each part starts on a block boundary in the source and in the
parameter, and ends on one or at the end of both, so every block of the parameter is
one block of the source, scaled by its own elements wherever it is quantized.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlferry.errors import RequestError

from .._errors import BlockFP8Error
from ._boxes import Box, box_str

__all__ = [
    "BLOCK",
    "BLOCK_FP8",
    "FP8",
    "QUANTIZE",
    "aligned",
    "block_box",
    "check_aligned",
    "check_engine_dtype",
    "quantized_by_default",
    "scale_name",
    "scale_shape",
]

BLOCK = 128  # rows and columns of a block
BLOCK_FP8 = "fp8_block128"  # the engine dtype name: linear layers' weights in block FP8
QUANTIZE = "block128"  # ParamLayout.quantize of a block-FP8 parameter
FP8 = torch.float8_e4m3fn


def scale_name(name: str) -> str:
    """The name of a block-FP8 parameter's scales (``x.weight`` -> ``x.weight_scale_inv``)."""
    return f"{name}_scale_inv"


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def scale_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of a block-FP8 tensor's scales: one per block of its last two dims."""
    *lead, rows, cols = shape
    return (*lead, _blocks(rows), _blocks(cols))


def aligned(box: Box, shape: Sequence[int]) -> bool:
    """Whether ``box`` (of a tensor of ``shape``) is made of whole blocks: on its last two
    dims it starts on a block boundary and ends on one or at the tensor's end."""
    return all(
        lo % BLOCK == 0 and (hi % BLOCK == 0 or hi == n)
        for (lo, hi), n in zip(box[-2:], shape[-2:], strict=True)
    )


def block_box(box: Box) -> Box:
    """An aligned box in the coordinates of the blocks (its scales' box)."""
    return (*box[:-2], *((lo // BLOCK, _blocks(hi)) for lo, hi in box[-2:]))


def check_aligned(box: Box, shape: Sequence[int], what: str, fix: str) -> None:
    """A :class:`BlockFP8Error` naming ``what`` unless ``box`` is made of whole blocks."""
    if not aligned(box, shape):
        raise BlockFP8Error(
            f"{what}: expected a region of whole {BLOCK} x {BLOCK} blocks of its last two "
            f"dims (each starts at a multiple of {BLOCK} and ends at one or at the end of "
            f"shape {list(shape)}), got {box_str(box)} ({fix})"
        )


def quantized_by_default(name: str, shape: Sequence[int]) -> bool:
    """Whether the engine dtype ``fp8_block128`` keeps this tensor in block FP8: the weights
    that linear layers multiply by (``*_proj.weight`` and fused experts' ``gate_up_proj``
    and ``down_proj``), as FP8 checkpoints keep them; embeddings, ``lm_head``, norms,
    routers and biases stay in the trainer's dtype."""
    parts = name.split(".")
    if len(shape) < 2 or len(parts) < 2:
        return False
    if parts[-2] == "experts" and len(shape) == 3:
        return parts[-1] in ("gate_up_proj", "down_proj")
    return parts[-1] == "weight" and "_proj" in parts[-2] and len(shape) == 2


def check_engine_dtype(dtype: object, field: str) -> None:
    """A RequestError naming ``field`` unless ``dtype`` is None, a torch dtype or
    ``"fp8_block128"``."""
    if dtype is not None and not isinstance(dtype, torch.dtype) and dtype != BLOCK_FP8:
        raise RequestError(
            f"{field}: expected a torch dtype or {BLOCK_FP8!r} (block FP8), got {dtype!r}"
        )
