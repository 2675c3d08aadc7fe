"""Copies of many tensors at once: a bucket packed, a bucket loaded into an engine.

:class:`GroupedCopy` copies many pairs of tensors in one launch on CUDA (a Triton
kernel over a table of chunks) and one bulk copy on the CPU; :class:`ParamLoader` is a
receiver's ready ``load`` built on it. The sender packs each bucket, and a receiver
unpacks it, with these copies (``_pack``).
"""

from ._copy import GroupedCopy, ParamLoader

__all__ = ["GroupedCopy", "ParamLoader"]
