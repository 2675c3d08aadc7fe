"""Block-scaled FP8: a weight as ``float8_e4m3fn`` values and one float32 scale per block.

The layout of DeepSeek-V3 and Kimi-K2 checkpoints and of vLLM's block-FP8 linear layers:
``weight`` (``float8_e4m3fn``, the weight's shape) and ``weight_scale_inv`` (float32,
``[..., ceil(rows / 128), ceil(cols / 128)]``, one per 128 x 128 block of the last two
dims; leading dims, a stack of experts, kept), the dequantization multiplier:
``w ~= weight * weight_scale_inv`` block by block.

The arithmetic is vLLM's ``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``, DeepGEMM's
reference, without UE8M0 scales) as it runs on a GPU, bit for bit: a block's ``amax``
(the largest magnitude of its elements, in float32) is clamped below at 1e-4 (an
all-zero block gets the scale 1e-4 / 448 and zeros); its scale is ``amax / 448`` as torch
computes it on CUDA, ``amax * float32(1 / 448)`` (a division by a Python number is a
multiplication by its reciprocal there; on the CPU torch divides, which differs in the
last bit of some scales, so this module multiplies on every device); each value is
``float8_e4m3fn(float32(w) * (1 / scale))``, the reciprocal correctly rounded and the
cast rounded to nearest even. A block cut by the tensor's last row or column is scaled
by the elements it has (vLLM pads it with zeros, which leave an amax of 1e-4 or more as
it is). transformers' ``Fp8Quantize`` differs in the last bit of some values and scales
(it multiplies by ``448 / amax`` and stores the reciprocal, and gives an all-zero block
the scale 1); DeepSeek-V3's ``act_quant`` divides by ``amax / 448`` (activations, 1 x 128
blocks, no floor).

:func:`quantize_block_fp8` runs where the tensor lies: on CUDA one Triton kernel (one
program a block: the block read once, its values and scale written; falls back to the
torch ops without Triton), elsewhere torch ops on the tensor reshaped into blocks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..planning._blocks import BLOCK, FP8, scale_shape
from ._copy import triton_available

__all__ = ["AMAX_FLOOR", "FP8_MAX", "INV_FP8_MAX", "dequantize_block_fp8", "quantize_block_fp8"]

FP8_MAX = 448.0  # the largest float8_e4m3fn
AMAX_FLOOR = 1e-4  # a block's amax is at least this (vLLM's clamp)
INV_FP8_MAX = 1.0 / FP8_MAX  # scale = amax * float32(this): torch's amax / 448 on CUDA


def quantize_block_fp8(
    w: torch.Tensor, *, kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (2 dims or more, any float dtype, any strides) as block FP8: its values
    (``float8_e4m3fn``, ``w``'s shape, contiguous) and their scales (float32,
    ``[..., ceil(rows / 128), ceil(cols / 128)]``), on ``w``'s device.

    ``kernel``: use the Triton kernel (default: on CUDA when Triton is there); False, the
    torch ops. Both give the same bits."""
    if w.dim() < 2 or not w.dtype.is_floating_point:
        raise ValueError(
            f"quantize_block_fp8: expected a float tensor of 2 dims or more, got "
            f"{w.dtype} {list(w.shape)}"
        )
    if kernel is None:
        kernel = w.is_cuda and triton_available()
    if kernel and w.numel():
        return _kernel_quantize(w)
    return _torch_quantize(w)


def dequantize_block_fp8(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``values * scales`` block by block, in ``dtype`` (computed in float32)."""
    *_, rows, cols = values.shape
    s = scales.repeat_interleave(BLOCK, -2)[..., :rows, :]
    s = s.repeat_interleave(BLOCK, -1)[..., :cols]
    return (values.float() * s).to(dtype)


@torch.no_grad()
def _torch_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, rows, cols = w.shape
    pr, pc = -rows % BLOCK, -cols % BLOCK
    x = torch.nn.functional.pad(w, (0, pc, 0, pr)) if pr or pc else w
    x = x.reshape(*lead, (rows + pr) // BLOCK, BLOCK, (cols + pc) // BLOCK, BLOCK)
    amax = x.abs().amax(dim=(-3, -1), keepdim=True).float().clamp_(min=AMAX_FLOOR)
    scale = amax * INV_FP8_MAX  # a float32 multiply on every device
    q = (x.float() * torch.reciprocal(scale)).to(FP8)
    q = q.reshape(*lead, rows + pr, cols + pc)
    if pr or pc:
        q = q[..., :rows, :cols].contiguous()
    return q, scale.reshape(scale_shape(w.shape))


def _kernel_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape[-2:]
    x = w.reshape(-1, rows, cols)  # a view where the leading dims allow it
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    s = torch.empty(scale_shape(w.shape), dtype=torch.float32, device=w.device)
    grid = (x.shape[0] * s.shape[-2], s.shape[-1])
    with torch.cuda.device(w.device):
        _launcher()[grid](
            x, q, s, rows, cols, s.shape[-2], x.stride(0), x.stride(1), x.stride(2),
            BLOCK=BLOCK, AMAX_FLOOR=AMAX_FLOOR, INV=INV_FP8_MAX, num_warps=8,
        )  # fmt: skip
    return q, s


@functools.cache
def _launcher() -> Any:
    from ._fp8_kernel import quantize_blocks

    return quantize_blocks
