"""Copies of many tensors at once: a bucket packed, a bucket loaded into an engine.

:class:`GroupedCopy` copies many pairs of tensors in one launch on CUDA (a Triton
kernel over a table of chunks) and one bulk copy on the CPU; :class:`ParamLoader` is a
receiver's ready ``load`` built on it. The sender packs each bucket, and a receiver
unpacks it, with these copies (``_pack``). :func:`quantize_block_fp8` makes a weight's
block-FP8 values and scales where it lies (a Triton kernel on CUDA: ``_fp8``), and
:func:`dequantize_block_fp8` reads them back.
"""

from ._copy import GroupedCopy, ParamLoader
from ._fp8 import dequantize_block_fp8, quantize_block_fp8

__all__ = ["GroupedCopy", "ParamLoader", "dequantize_block_fp8", "quantize_block_fp8"]
