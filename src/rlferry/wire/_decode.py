"""The codec's decoding side: frames back into the value :func:`~._codec.encode` made.

Every tensor is a view over its frame: no copy. Every length in a header is checked
against the frames actually received before anything is built, so a lying header raises
:class:`WireError` and never allocates memory sized by the sender; nothing is unpickled.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from ._codec import (
    EXT_JAGGED,
    EXT_NDARRAY,
    EXT_RAGGED,
    EXT_STRS,
    EXT_TENSOR,
    EXT_TENSORS,
    EXT_TUPLE,
    MAGIC,
    MAX_DIMS,
    NUMPY_KINDS,
    Buffer,
)
from ._errors import WireError
from ._refs import DTYPE_NAMES, DTYPES, TensorRef, address_of
from .columns import KINDS, PackedRows, PackedStrings, RaggedRows, check_offsets
from .memory._bulk import BulkFrame

__all__ = ["decode"]

_HEAD = msgspec.msgpack.Decoder(tuple[str, int, msgspec.Raw])


class _Decoding:
    """The state of one decode: the frames, which of them were used."""

    def __init__(
        self, frames: Sequence[Buffer], forward: bool = False, tensors: bool = True
    ) -> None:
        self.forward = forward
        self.tensors = tensors
        self.frames = frames
        self.views = [_byte_view(f, i + 1) for i, f in enumerate(frames)]
        self.used = [False] * len(self.views)  # by one node alone
        self.shared = [False] * len(self.views)  # by nodes that give their offset in it
        self.bases: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.addresses: dict[int, int] = {}  # id(whole) -> its address (for TensorRefs)
        self.decoder = msgspec.msgpack.Decoder(ext_hook=self.ext)

    def frame(self, index: Any, what: str) -> memoryview:
        if type(index) is not int or not 1 <= index <= len(self.views):
            raise WireError(
                f"malformed message: {what} names frame {index!r}, "
                f"the message has frames 1..{len(self.views)}"
            )
        if self.used[index - 1] or self.shared[index - 1]:
            raise WireError(f"malformed message: frame {index} is used twice")
        self.used[index - 1] = True
        return self.views[index - 1]

    def shared_frame(self, index: Any) -> memoryview:
        if type(index) is not int or not 1 <= index <= len(self.views):
            raise WireError(
                f"malformed message: a tensor names frame {index!r}, "
                f"the message has frames 1..{len(self.views)}"
            )
        if self.used[index - 1]:
            raise WireError(f"malformed message: frame {index} is used twice")
        self.shared[index - 1] = True
        return self.views[index - 1]

    def ext(self, code: int, data: memoryview) -> Any:
        if code == EXT_TUPLE:
            items = self.decoder.decode(data)
            if not isinstance(items, list):
                raise WireError("malformed message: a tuple node does not hold a list")
            return tuple(items)
        if not self.tensors:
            raise WireError(
                "malformed message: a tensor, array or packed list in a message to a service "
                "that takes plain values only"
            )
        node = msgspec.msgpack.decode(data)
        if code == EXT_TENSOR:
            return self.tensor(node, self.forward)
        if code == EXT_RAGGED:
            return self.ragged(node)
        if code == EXT_JAGGED:
            return self.jagged(node)
        if code == EXT_NDARRAY:
            return self.ndarray(node)
        if code == EXT_STRS:
            return self.strings(node)
        if code == EXT_TENSORS:
            return self.tensor_dict(node)
        raise WireError(f"malformed message: unknown extension code {code}")

    def tensor(self, node: Any, ref: bool = False) -> Any:
        """The tensor of a tensor node; with ``ref``, a :class:`TensorRef` where it lies
        in shared memory."""
        if type(node) is not list or not 3 <= len(node) <= 4:
            raise WireError("malformed message: a tensor node is not [dtype, shape, frame]")
        if len(node) == 4:
            return self.cut(node[2], node[0], node[1], node[3], self.shared_frame(node[2]), ref)
        return self.cut(node[2], node[0], node[1], 0, None, ref)

    def tensor_dict(self, node: Any) -> dict[str, Any]:
        if not (type(node) is list and len(node) == 2 and type(node[1]) is list):
            raise WireError("malformed message: a tensor dict node is not [frame, groups]")
        index, groups = node
        view = self.shared_frame(index)
        out: dict[str, Any] = {}
        for group in groups:
            if not (
                type(group) is list
                and len(group) == 5
                and type(group[0]) is list
                and set(map(type, group[0])) == {str}  # and not empty
                and type(group[3]) is int
                and type(group[4]) is int
                and group[4] >= 0
            ):
                raise WireError(
                    "malformed message: a tensor group is not "
                    "[keys, dtype, shape, byte offset, byte step >= 0]"
                )
            keys, name, shape, at, step = group
            first = self.cut(index, name, shape, at, view, self.forward)
            if len(keys) == 1:
                out[keys[0]] = first
                continue
            if step < max(first.nbytes, 1):  # else one frame would feed any number of tensors
                raise WireError(
                    f"malformed message: a tensor group of {first.nbytes}-byte tensors has "
                    f"byte step {step} (its tensors must not overlap)"
                )
            last = at + step * (len(keys) - 1)  # in bounds, then all are
            if last + first.nbytes > view.nbytes:
                raise _outside(first.nbytes, last, index, view)
            out.update(zip(keys, self.spaced(index, view, first, at, step, len(keys)), strict=True))
        return out

    def spaced(
        self, index: int, view: memoryview, first: Any, at: int, step: int, count: int
    ) -> list[Any]:
        """``count`` tensors like ``first`` (cut at byte ``at``), ``step`` bytes apart."""
        frame = self.frames[index - 1]
        whole, start = (frame.whole, frame.offset + at) if type(frame) is BulkFrame else (view, at)
        if type(first) is TensorRef:
            return [
                TensorRef(whole, first.address, first.dtype, first.shape, start + i * step)
                for i in range(count)
            ]
        base = self.bases.get((id(whole), first.dtype))
        size = first.element_size()
        if base is None or not first.numel() or start % size or step % size:
            name, shape = DTYPE_NAMES[first.dtype], list(first.shape)
            return [self.cut(index, name, shape, at + i * step, view) for i in range(count)]
        every = base.as_strided(
            [count, *first.shape], [step // size, *first.stride()], start // size
        )
        return list(every.unbind(0))

    def dtype(self, name: Any) -> torch.dtype:
        dtype = DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            raise WireError(f"malformed message: unknown dtype {name!r}")
        return dtype

    def cut(
        self,
        index: Any,
        name: Any,
        shape: Any,
        at: Any,
        view: memoryview | None = None,
        ref: bool = False,
    ) -> Any:
        """The tensor of ``name`` and ``shape`` at byte ``at`` of frame ``index`` (checked):
        the whole frame, or, given the ``view`` of a shared frame, a part of it. With
        ``ref``, a tensor that lies in shared memory comes as a :class:`TensorRef`."""
        dtype = self.dtype(name)
        size = dtype.itemsize
        strides = _strides_of(shape)  # checks the shape
        nbytes = (strides[0] * shape[0] if shape else 1) * size
        if view is None:
            view = self.frame(index, "a tensor")
            if nbytes != view.nbytes:
                raise WireError(
                    f"malformed message: tensor of shape {shape} and dtype {name} "
                    f"needs {nbytes} bytes, frame {index} has {view.nbytes}"
                )
        elif type(at) is not int or at < 0 or at + nbytes > view.nbytes:
            raise _outside(nbytes, at, index, view)
        frame = self.frames[index - 1]
        if type(frame) is not BulkFrame:
            whole = view
        else:
            whole, at = frame.whole, frame.offset + at
            if ref and not whole.readonly:
                address = self.addresses.get(id(whole))
                if address is None:
                    address = self.addresses[id(whole)] = address_of(whole)
                return TensorRef(whole, address, name, shape, at)
        if nbytes == 0 or whole.readonly or at % size:
            return _as_tensor(whole[at : at + nbytes], dtype, shape)
        base = self.bases.get((id(whole), dtype))
        if base is None:  # the frame's memory as one tensor: its tensors are cut from it
            usable = whole.nbytes - whole.nbytes % size
            raw = torch.frombuffer(whole, dtype=torch.uint8, count=usable)
            base = self.bases[(id(whole), dtype)] = raw.view(dtype)
        return base.as_strided(shape, strides, at // size)

    def ragged(self, node: Any) -> RaggedRows | PackedRows:
        if not (isinstance(node, list) and len(node) == 3 and isinstance(node[1], list)):
            raise WireError("malformed message: a ragged node is not [dtype, shapes, frame]")
        name, shapes, index = node
        dtype = self.dtype(name)
        sizes = [_checked_numel(s) * dtype.itemsize for s in shapes]
        view = self.frame(index, "a ragged list")
        if sum(sizes) != view.nbytes:
            raise WireError(
                f"malformed message: ragged shapes need {sum(sizes)} bytes, "
                f"frame {index} has {view.nbytes}"
            )
        whole = _as_tensor(view, torch.uint8, [view.nbytes]).view(dtype)
        if self.forward:  # stored and sent on: no tensor a row
            return PackedRows(whole, shapes)
        return RaggedRows(whole, shapes)  # views of it, made at once

    def jagged(self, node: Any) -> torch.Tensor:
        if not (isinstance(node, list) and len(node) == 3 and type(node[2]) is int):
            raise WireError("malformed message: a jagged node is not [values, offsets, ragged_idx]")
        values, offsets = self.tensor(node[0]), self.tensor(node[1])
        check_offsets(offsets, values.shape[0] if values.dim() else -1, "jagged")
        if not 1 <= node[2] <= values.dim():
            raise WireError(f"malformed message: jagged dimension {node[2]} of {values.dim()}")
        try:
            return torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=node[2])
        except (RuntimeError, ValueError, IndexError) as e:
            raise WireError(f"malformed message: jagged tensor does not build ({e})") from None

    def strings(self, node: Any) -> Any:
        if not (isinstance(node, list) and len(node) == 3 and node[0] in KINDS):
            raise WireError("malformed message: a strings node is not [kind, offsets, data]")
        offsets, data = self.tensor(node[1]), self.tensor(node[2])
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise WireError("malformed message: string data is not bytes")
        check_offsets(offsets, data.numel())
        packed = PackedStrings(node[0], offsets, data)
        return packed if self.forward else packed.tolist()

    def ndarray(self, node: Any) -> Any:
        import numpy as np

        if not (isinstance(node, list) and len(node) == 3 and isinstance(node[0], str)):
            raise WireError("malformed message: an array node is not [dtype, shape, frame]")
        try:
            dtype = np.dtype(node[0])
        except TypeError:
            raise WireError(f"malformed message: unknown numpy dtype {node[0]!r}") from None
        if dtype.kind not in NUMPY_KINDS or dtype.fields is not None:
            raise WireError(f"malformed message: numpy dtype {node[0]!r} is not allowed")
        numel = _checked_numel(node[1])
        view = self.frame(node[2], "an array")
        if numel * dtype.itemsize != view.nbytes:
            raise WireError(
                f"malformed message: array of shape {node[1]} needs "
                f"{numel * dtype.itemsize} bytes, frame {node[2]} has {view.nbytes}"
            )
        return np.frombuffer(view, dtype=dtype).reshape(node[1])


def _checked_numel(shape: Any) -> int:
    if type(shape) is list and len(shape) <= MAX_DIMS:
        numel = 1
        for d in shape:
            if type(d) is not int or d < 0:
                break
            numel *= d
        else:
            return numel
    raise WireError(f"malformed message: {shape!r} is not a shape (non-negative ints)")


def _byte_view(frame: Buffer, index: int) -> memoryview:
    buf: Any = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    try:
        view = memoryview(buf)
    except TypeError:
        raise WireError(f"frame {index} is a {type(frame).__name__}, not a buffer") from None
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _outside(nbytes: int, at: Any, index: Any, view: memoryview) -> WireError:
    return WireError(
        f"malformed message: tensor of {nbytes} bytes at offset {at!r} "
        f"of frame {index}, which has {view.nbytes}"
    )


def _strides_of(shape: Any) -> list[int]:
    """The contiguous strides of ``shape``, checked to be a shape (non-negative ints)."""
    if type(shape) is list and len(shape) <= MAX_DIMS:
        out = [1] * len(shape)
        step = 1
        for i in range(len(shape) - 1, -1, -1):
            d = shape[i]
            if type(d) is not int or d < 0:
                break
            out[i] = step
            step *= d
        else:
            return out
    raise WireError(f"malformed message: {shape!r} is not a shape (non-negative ints)")


def _as_tensor(view: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if view.readonly:  # bytes: torch cannot alias read-only memory safely, so copy once
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(shape)


def decode(frames: Sequence[Buffer], *, forward: bool = False, tensors: bool = True) -> Any:
    """Rebuild the value of :func:`encode` from its frames, without copying tensor data.

    Tensors and arrays are views over the frames' memory (zmq frames received
    with ``copy=False`` are writable, so the tensors are too); read-only frames
    such as ``bytes`` are copied once.

    ``forward``: for services that store values and send them on without using them
    (storage units). Long lists of str or bytes come back as :class:`PackedStrings`,
    and tensors that lie in shared memory as :class:`TensorRef`: no Python string
    and no torch object per value.

    ``tensors=False``: for services whose requests hold plain values only (a
    controller): any tensor, array or packed list in the header is refused before
    anything is built.

    Raises:
        WireError: missing, extra or truncated frames, or a header that does not
            describe them. Nothing is allocated from sizes the header claims.
    """
    if not frames:
        raise WireError("malformed message: no frames (expected a header frame)")
    try:
        magic, count, tree = _HEAD.decode(_byte_view(frames[0], 0))
    except (msgspec.DecodeError, ValueError, RecursionError):
        raise WireError(
            "malformed message: the header is not an rlferry header "
            f"(expected [{MAGIC!r}, frames, value])"
        ) from None
    if magic != MAGIC:
        raise WireError(f"malformed message: header version {magic!r}, expected {MAGIC!r}")
    if count != len(frames) - 1:
        raise WireError(
            f"malformed message: header announces {count} data frames, {len(frames) - 1} arrived"
        )
    state = _Decoding(frames[1:], forward, tensors)
    try:
        value = state.decoder.decode(tree)
    except WireError:
        raise
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError, OverflowError) as e:
        raise WireError(f"malformed message: header does not decode ({e})") from None
    finally:
        del state.decoder  # break the decoder <-> hook cycle: frames are freed by refcount
    unused = [i for i, (a, b) in enumerate(zip(state.used, state.shared, strict=True)) if not a | b]
    if unused:
        raise WireError(f"malformed message: frame {unused[0] + 1} is not used by the header")
    return value


if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError(
        "rlferry.wire sends tensors in native byte order and needs a little-endian host"
    )
