"""Tensors held by where they lie: for services that store and forward them.

A storage unit never computes on the tensors it holds; it keeps them and
sends row ranges of them on. Received through shared memory, such a tensor is
fully described by its place (the mapped segment, a byte offset), its dtype
and its shape, so the unit keeps a :class:`TensorRef` instead: no torch object
per tensor on receipt, none on reply, where building and inspecting torch
tensors costs microseconds each (a put or get of 32 fields paid it 32 times).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "ITEMSIZE", "TensorRef", "address_of", "materialized"]

DTYPES: dict[str, torch.dtype] = {}
for _name in [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
]:
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        DTYPES[_name] = _dt
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}
ITEMSIZE = {name: dt.itemsize for name, dt in DTYPES.items()}


def address_of(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class TensorRef:
    """A contiguous tensor in mapped shared memory: ``whole`` (the segment's view, kept
    alive by this reference), ``address`` (of ``whole``), ``dtype`` (its wire name),
    ``shape`` and the byte ``offset`` of its first element in ``whole``.

    Sliced by rows (``ref[a:b]``) it stays a reference; :meth:`tensor` builds the
    tensor, a view of the memory. Made by ``decode(..., forward=True)`` and sent on
    by ``encode(..., shared=True)`` as a view of the same memory, with no copy.
    """

    __slots__ = ("address", "dtype", "offset", "shape", "whole")

    def __init__(
        self, whole: memoryview, address: int, dtype: str, shape: list[int], offset: int
    ) -> None:
        self.whole = whole
        self.address = address
        self.dtype = dtype
        self.shape = shape
        self.offset = offset

    def _row_bytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self._row_bytes() * self.shape[0] if self.shape else ITEMSIZE[self.dtype]

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor reference")
        return self.shape[0]

    def __getitem__(self, rows: slice) -> TensorRef:
        """Rows ``[start, stop)``: a reference to them."""
        if type(rows) is not slice or not self.shape:
            raise TypeError("a TensorRef supports row slices (ref[a:b]) of a tensor of rows")
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise IndexError("a TensorRef supports contiguous row slices only")
        stop = max(start, stop)
        at = self.offset + start * self._row_bytes()
        return TensorRef(self.whole, self.address, self.dtype, [stop - start, *self.shape[1:]], at)

    def tensor(self) -> torch.Tensor:
        """The tensor, a view of the shared memory (no copy)."""
        dtype = DTYPES[self.dtype]
        part = self.whole[self.offset : self.offset + self.nbytes]
        if not part.nbytes:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(part, dtype=torch.uint8).view(dtype).reshape(self.shape)

    def __repr__(self) -> str:
        return f"TensorRef({self.dtype}, {self.shape}, at {self.offset:#x} of {self.address:#x})"


def materialized(value: Any) -> Any:
    """``value`` with a :class:`TensorRef` made a tensor."""
    return value.tensor() if type(value) is TensorRef else value
