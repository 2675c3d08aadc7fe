"""One tensor's sparse change (:class:`Delta`) and the bytes it travels in.

A changed tensor travels as one byte tensor, pushed under ``{name}\\x00delta``:
``counts`` (int16, the changed elements of each block of :data:`BLOCK` elements), then
``values`` (the new elements, in the tensor's dtype, 16-byte aligned), then ``offsets``
(uint8, each changed element's place in its block). One piece per tensor: the plan may
split it over buckets like any tensor, and the receiver's ``load`` gets it whole.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from rlferry.errors import RequestError

from ..planning._delta_layout import BLOCK, layout
from ._native import THREADS, fastdiff

__all__ = ["BLOCK", "SUFFIX", "Delta", "comparable", "int_view", "kernels", "layout", "parts_name"]

SUFFIX = "\x00delta"  # a changed tensor's pushed name: its own name, then this
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def parts_name(name: str) -> str:
    """The name a changed tensor's bytes are pushed under."""
    return name + SUFFIX


def kernels(device: torch.device) -> bool:
    """Whether deltas on ``device`` are made and applied by the Triton kernels of
    ``_diff_kernel``: on CUDA, where Triton can be imported."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def comparable(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can be diffed (compared as integers of its size)."""
    return dtype.itemsize in _INTS


def int_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` (contiguous) flat, as integers of its element size (compared bit for bit);
    None for an element size that has none (complex128)."""
    ints = _INTS.get(t.element_size())
    return t.reshape(-1).view(ints) if ints is not None else None


@dataclass(frozen=True)
class Delta:
    """The change of one tensor from the version a receiver holds to the pushed one.

    ``counts[b]`` elements changed in block ``b`` (elements ``b * 256`` to ``b * 256 +
    255`` of the flat tensor); ``offsets`` (uint8) give each one's place in its block and
    ``values`` its new value, block after block. :meth:`apply_` writes them into a tensor
    that holds the base version: bit for bit the pushed tensor.
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def from_bytes(
        cls, data: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, changed: int
    ) -> Delta:
        """The delta in ``data`` (a byte tensor laid out by :func:`layout`); views, no copy."""
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        blocks, values_at, offsets_at, nbytes = layout(numel, changed, itemsize)
        if data.dtype != torch.uint8 or data.numel() != nbytes:
            raise RequestError(
                f"delta of {list(shape)} {dtype}: expected {nbytes} bytes for {changed} changed "
                f"elements, got {data.numel()} {data.dtype}"
            )
        return cls(
            data[: 2 * blocks].view(torch.int16),
            data[offsets_at:nbytes],
            data[values_at:offsets_at].view(dtype),
            tuple(shape),
            dtype,
        )

    @property
    def changed(self) -> int:
        """How many elements changed."""
        return self.values.numel()

    @property
    def nbytes(self) -> int:
        """The bytes it travels in."""
        return layout(self.numel, self.changed, self.values.element_size())[3]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def indices(self) -> torch.Tensor:
        """Each changed element's place in the flat tensor (int64, on the parts' device),
        with no host round trip: the block of each by ``repeat_interleave`` of the counts,
        its output size given."""
        n = self.changed
        blocks = torch.repeat_interleave(
            torch.arange(self.counts.numel(), device=self.counts.device),
            self.counts.to(torch.int64),
            output_size=n,
        )
        return blocks * BLOCK + self.offsets.to(torch.int64)

    def apply_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Write the changed elements into ``tensor`` (the base version: contiguous, of this
        delta's shape and dtype, on any device); returns it. On ``tensor``'s device, no host
        round trip: on CUDA a Triton kernel (torch ops without Triton), queued on the
        current stream.

        Raises ``RequestError`` (a ``ValueError``) for a tensor of another shape or dtype,
        or not contiguous."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise RequestError(
                f"Delta.apply_: expected a tensor of shape {list(self.shape)} "
                f"{str(self.dtype).removeprefix('torch.')}, got {list(tensor.shape)} "
                f"{str(tensor.dtype).removeprefix('torch.')}"
            )
        if not tensor.is_contiguous():
            raise RequestError(
                "Delta.apply_: expected a contiguous tensor (it is written in place by its "
                "flat positions), got a strided view"
            )
        if self.changed == 0:
            return tensor
        flat = int_view(tensor)
        if flat is None:
            raise RequestError(f"Delta.apply_: a {self.dtype} tensor cannot take deltas")
        dev = tensor.device
        delta = self if self.counts.device == dev else self.to(dev)
        if kernels(dev):
            from ._diff_kernel import apply

            apply(flat, delta.counts, delta.offsets, delta.values.view(flat.dtype))
        elif not (dev.type == "cpu" and delta._apply_natively(flat)):
            flat.index_copy_(0, delta.indices(), delta.values.view(flat.dtype))
        return tensor

    def _apply_natively(self, flat: torch.Tensor) -> bool:
        """Write the changes into ``flat`` (a CPU tensor's flat integer view) with the C
        extension; False (nothing written) where it is absent or the parts are not
        contiguous CPU tensors that fit ``flat`` (torch ops apply it, or raise)."""
        parts = (self.counts, self.offsets, self.values)
        if fastdiff is None or any(t.device.type != "cpu" or not t.is_contiguous() for t in parts):
            return False
        n = self.values.numel()
        if (
            self.counts.dtype != torch.int16
            or self.offsets.dtype != torch.uint8
            or self.offsets.numel() != n
            or self.counts.numel() != -(-flat.numel() // BLOCK)
        ):
            return False
        return fastdiff.apply(
            flat.data_ptr(), flat.numel(), flat.element_size(), self.counts.data_ptr(),
            self.offsets.data_ptr(), self.values.data_ptr(), n, THREADS,
        )  # fmt: skip

    def to(self, device: torch.device | str) -> Delta:
        """This delta with its parts on ``device`` (queued on the current stream for a CUDA
        device; a copy to the host is waited for)."""
        ahead = torch.device(device).type == "cuda"
        counts, offsets, values = (
            t.to(device, non_blocking=ahead) for t in (self.counts, self.offsets, self.values)
        )
        return Delta(counts, offsets, values, self.shape, self.dtype)
