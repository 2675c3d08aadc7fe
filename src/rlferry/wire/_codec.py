"""The codec: a value becomes one msgpack header plus one raw frame per tensor buffer.

Frame 0 is the header, ``[MAGIC, number_of_data_frames, tree]``. The tree is the
value itself in msgpack, with msgpack *extension* nodes where msgpack has no
type of its own: tensors, numpy arrays, tuples, ragged lists of tensors and
jagged nested tensors. An extension node holds a small msgpack description
(dtype, shape, index of its data frame); the bytes themselves are the data
frames that follow the header, never copied into it.

Sent through shared memory (``encode(..., shared=True)``), tensors that are views
of one shared-memory storage (the columns of one put, say) travel as one frame,
the storage, and their nodes say at which byte offset of it each one starts: one
frame and one mapping however many tensors, not one per tensor. A dict of such tensors
and nothing else (a read of a put's columns) is one node for all of them.

Decoding (`_decode.py`) builds every tensor as a view over its frame: no copy. Every length in
a header is checked against the frames actually received before anything is
built, so a lying header raises :class:`WireError` and never allocates memory
sized by the sender. Nothing is ever pickled: a value of a type not listed in
:func:`encode` is refused.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from rlferry.errors import RlferryError

from ._errors import WireError
from ._refs import DTYPE_NAMES, TensorRef
from .columns import PackedRows, PackedStrings, RaggedRows, pack_strings
from .memory._copies import in_order
from .memory._segments import BULK_MIN, exports, shared_empty

__all__ = [
    "EXT_JAGGED",
    "EXT_NDARRAY",
    "EXT_RAGGED",
    "EXT_STRS",
    "EXT_TENSOR",
    "EXT_TENSORS",
    "EXT_TUPLE",
    "MAGIC",
    "MAX_DIMS",
    "NUMPY_KINDS",
    "Buffer",
    "encode",
    "tensor_buffer",
    "tensor_refusal",
]

Buffer = Any  # anything with the buffer protocol: bytes, memoryview, zmq.Frame

MAGIC = "rlf1"
MAX_DIMS = 64

# Extension codes of the header tree (the decoder reads the same).
EXT_TENSOR = 1  # [dtype, shape, frame] or [dtype, shape, frame, byte offset] (a shared frame)
EXT_NDARRAY = 2  # [dtype.str, shape, frame]
EXT_TUPLE = 3  # packed list of the items
EXT_RAGGED = 4  # [dtype, [shape, ...], frame]: a list of tensors packed into one frame
EXT_JAGGED = 5  # [values ext, offsets ext, ragged_idx]: torch.nested jagged tensor
EXT_STRS = 6  # [kind, offsets ext node, data ext node]: a long list of str or bytes, packed
EXT_TENSORS = 7  # [frame, [group, ...]]: a dict of tensors of one storage (see _group)

NUMPY_KINDS = "biufc"

_SCALARS = frozenset((int, float, str, bytes, bool, type(None)))

ACCEPTED = (
    "torch.Tensor, numpy.ndarray, None, bool, int, float, str, bytes, "
    "list, tuple, dict with str keys"
)


class _Refused(RlferryError):
    """Raised deep in the tree; the path is added while the stack unwinds."""

    def __init__(self, path: list[str], reason: str) -> None:
        self.path = path
        self.reason = reason


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, keeping the tensor alive."""
    return _bytes_at(t.data_ptr(), t.numel() * t.element_size(), t)


def _bytes_at(address: int, nbytes: int, owner: torch.Tensor) -> memoryview:
    """A writable byte view of memory that ``owner`` (kept alive by the view) holds."""
    holder = (ctypes.c_char * nbytes).from_address(address) if nbytes else (ctypes.c_char * 0)()
    holder._rlferry_owner = owner  # type: ignore[attr-defined]
    return memoryview(holder).cast("B")


def _plain(t: torch.Tensor) -> bool:
    """A CPU tensor whose memory holds its values in order (the usual case): sent as is."""
    return (
        t.layout == torch.strided
        and t.is_cpu
        and t.dtype in DTYPE_NAMES
        and not t.requires_grad
        and in_order(t)
    )


def tensor_refusal(t: torch.Tensor) -> str | None:
    """Why the codec refuses ``t``, or None if it travels (its data is not touched)."""
    if t.is_nested:
        if t.layout != torch.jagged:
            return "a strided nested tensor (convert it to layout=torch.jagged)"
        if getattr(t, "_lengths", None) is not None:
            return "a jagged nested tensor with holes (call .contiguous() first)"
        return tensor_refusal(t.values())
    if t.layout != torch.strided:
        return f"tensor layout {t.layout} is not supported (dense or jagged nested only)"
    if t.dtype not in DTYPE_NAMES:
        return f"tensor dtype {t.dtype} is not supported"
    if t.device.type == "meta":
        return "a meta tensor has no data to send"
    return None


def _host_contiguous(t: torch.Tensor) -> torch.Tensor:
    if _plain(t):
        return t
    why = tensor_refusal(t)
    if why is not None:
        raise _Refused([], why)
    if t.device.type != "cpu":
        t = t.detach().to("cpu")
    return t.detach().resolve_conj().resolve_neg().contiguous()  # lazy views: their values


class _Encoder:
    def __init__(self, shared: bool = False) -> None:
        self.frames: list[Buffer] = []
        self._packer = msgspec.msgpack.Encoder()
        self._shared = shared
        self._storages: dict[tuple[int, int], int] = {}  # (address, size) -> its frame

    def _add(self, buf: Buffer) -> int:
        self.frames.append(buf)
        return len(self.frames)  # data frames are numbered from 1; frame 0 is the header

    def tensor_node(self, t: torch.Tensor) -> list[Any]:
        t = _host_contiguous(t)
        if self._shared and t.numel():
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            frame = self._storage_frame(key, t)
            if frame is not None:
                return [DTYPE_NAMES[t.dtype], list(t.shape), frame, t.data_ptr() - key[0]]
        return [DTYPE_NAMES[t.dtype], list(t.shape), self._add(tensor_buffer(t))]

    def ref_node(self, r: TensorRef) -> list[Any]:
        """A reference to a tensor in shared memory: through shared memory it goes on as a
        view of the same memory; otherwise its bytes travel, like a tensor's."""
        if self._shared:
            frame = self._storage_frame((r.address, r.whole.nbytes), r.whole)
            if frame is not None:
                return [r.dtype, r.shape, frame, r.offset]
        return self.tensor_node(r.tensor())

    def _storage_frame(self, key: tuple[int, int], owner: Any) -> int | None:
        """The frame of the shared-memory storage at ``key`` (address, size), added once;
        None when that memory is not this process's shared memory."""
        frame = self._storages.get(key)
        if frame is None and key[1] >= BULK_MIN and exports.find(*key) is not None:
            frame = self._storages[key] = self._add(_bytes_at(key[0], key[1], owner))
        return frame

    def value(self, obj: Any) -> Any:
        # The common scalar kinds first: they need no work.
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        if isinstance(obj, torch.Tensor):
            if obj.is_nested:
                return self.nested(obj)
            return msgspec.msgpack.Ext(EXT_TENSOR, self._packer.encode(self.tensor_node(obj)))
        if type(obj) is TensorRef:
            return msgspec.msgpack.Ext(EXT_TENSOR, self._packer.encode(self.ref_node(obj)))
        if isinstance(obj, dict):
            if self._shared and len(obj) > 1:
                group = self.tensor_dict(obj)
                if group is not None:
                    return group
            out = {}
            for k, v in obj.items():
                if not isinstance(k, str):
                    raise _Refused(
                        [], f"dict key {k!r} of type {type(k).__name__} (keys must be str)"
                    )
                try:
                    out[k] = self.value(v)
                except _Refused as e:
                    e.path.append(f".{k}")
                    raise
            return out
        if isinstance(obj, list):
            ragged = self.ragged(obj)
            if ragged is not None:
                return ragged
            packed = pack_strings(obj)
            if packed is not None:
                return self.strings(packed)
            if set(map(type, obj)) <= _SCALARS:  # indexes, lengths, rewards: msgpack as is
                return obj
            return self.items(obj)
        if isinstance(obj, PackedStrings):
            return self.strings(obj)
        if type(obj) is PackedRows:
            return self._packed(obj.flat, [obj.flat], obj.shapes)
        if isinstance(obj, tuple):
            return msgspec.msgpack.Ext(EXT_TUPLE, self._packer.encode(self.items(obj)))
        if type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
            return self.ndarray(obj)
        raise _Refused([], f"type {type(obj).__module__}.{type(obj).__qualname__}")

    def tensor_dict(self, obj: dict[Any, Any]) -> msgspec.msgpack.Ext | None:
        """A dict whose values are all plain tensors of one shared-memory storage, or all
        references into one shared memory (the columns of one put, say): one node for all
        of them, None if it is anything else."""
        first = next(iter(obj.values()))
        if type(first) is TensorRef:
            return self.ref_dict(obj, first)
        entries: list[list[Any]] = []
        storage = None
        for k, t in obj.items():
            if not (type(t) is torch.Tensor and type(k) is str and _plain(t)):
                return None
            s = t.untyped_storage()
            if storage is None:
                storage = (s.data_ptr(), s.nbytes())
            elif s.data_ptr() != storage[0] or s.nbytes() != storage[1]:
                return None
            at = t.data_ptr() - storage[0]
            _group(entries, k, DTYPE_NAMES[t.dtype], list(t.shape), at, t.nbytes)
        frame = None if storage is None else self._storage_frame(storage, t)
        if frame is None:
            return None
        return msgspec.msgpack.Ext(EXT_TENSORS, self._packer.encode([frame, entries]))

    def ref_dict(self, obj: dict[Any, Any], first: TensorRef) -> msgspec.msgpack.Ext | None:
        memory = (first.address, first.whole.nbytes)
        entries: list[list[Any]] = []
        for k, r in obj.items():
            if not (type(r) is TensorRef and type(k) is str):
                return None
            if r.whole is not first.whole and (r.address, r.whole.nbytes) != memory:
                return None
            _group(entries, k, r.dtype, r.shape, r.offset, r.nbytes)
        frame = self._storage_frame(memory, first.whole)
        if frame is None:
            return None
        return msgspec.msgpack.Ext(EXT_TENSORS, self._packer.encode([frame, entries]))

    def strings(self, p: PackedStrings) -> msgspec.msgpack.Ext:
        offsets, data = p.parts()
        node = [p.kind, self.tensor_node(offsets), self.tensor_node(data)]
        return msgspec.msgpack.Ext(EXT_STRS, self._packer.encode(node))

    def items(self, seq: Sequence[Any]) -> list[Any]:
        out = []
        for i, v in enumerate(seq):
            try:
                out.append(self.value(v))
            except _Refused as e:
                e.path.append(f"[{i}]")
                raise
        return out

    def ragged(self, seq: list[Any]) -> msgspec.msgpack.Ext | None:
        """A non-empty list of dense tensors of one dtype travels as one packed frame (a
        :class:`RaggedRows` as its flat tensor: no row is read)."""
        # a RaggedRows whose flat tensor cannot travel: its rows tell which fails, and why
        if (
            type(seq) is RaggedRows
            and seq
            and seq.flat is not None
            and not tensor_refusal(seq.flat)
        ):
            return self._packed(seq.flat, [seq.flat], seq.shapes)
        if not seq or not all(type(t) is torch.Tensor and not t.is_nested for t in seq):
            return None
        dtype = seq[0].dtype
        if any(t.dtype != dtype for t in seq) or dtype not in DTYPE_NAMES:
            return None
        if any(t.layout != torch.strided or t.device.type == "meta" for t in seq):
            return None
        device = seq[0].device
        if any(t.device != device for t in seq):
            return None
        rows = [t if t.dim() == 1 else t.reshape(-1) for t in seq]
        return self._packed(seq[0], rows, [list(t.shape) for t in seq])

    def _packed(
        self, first: torch.Tensor, flat: list[torch.Tensor], shapes: list[list[int]]
    ) -> msgspec.msgpack.Ext:
        """The ragged node of rows ``flat`` (1-d, of ``first``'s dtype and device): one copy
        of every row at once (a copy per row cost ~8 us, 3 ms a put of the demo's 128 rows
        x 4 columns); a lazy conjugate/negative view gives its values."""
        with torch.no_grad():
            if first.device.type == "cpu":  # into warm shared memory: over ipc:// it is
                # not copied again
                total = sum(t.numel() for t in flat)
                packed = torch.cat(flat, out=shared_empty([total], first.dtype))
            else:
                packed = torch.cat(flat).cpu()
        node = [
            DTYPE_NAMES[first.dtype],
            shapes,
            self._add(tensor_buffer(packed.view(torch.uint8))),
        ]
        return msgspec.msgpack.Ext(EXT_RAGGED, self._packer.encode(node))

    def nested(self, t: torch.Tensor) -> msgspec.msgpack.Ext:
        why = tensor_refusal(t)
        if why is not None:
            raise _Refused([], why)
        values = self.tensor_node(t.values())
        offsets = self.tensor_node(t.offsets())  # type: ignore[attr-defined]
        node = [values, offsets, int(t._ragged_idx)]  # type: ignore[attr-defined]
        return msgspec.msgpack.Ext(EXT_JAGGED, self._packer.encode(node))

    def ndarray(self, a: Any) -> msgspec.msgpack.Ext:
        if a.dtype.kind not in NUMPY_KINDS or a.dtype.fields is not None:
            raise _Refused([], f"numpy dtype {a.dtype} (only bool, int, uint, float, complex)")
        import numpy as np

        shape = list(a.shape)
        flat: Any = np.ascontiguousarray(a).reshape(-1)
        buf = memoryview(flat).cast("B") if flat.nbytes else memoryview(b"")
        node = [a.dtype.str, shape, self._add(buf)]
        return msgspec.msgpack.Ext(EXT_NDARRAY, self._packer.encode(node))


def _group(
    groups: list[list[Any]], key: str, dtype: str, shape: list[int], at: int, nbytes: int
) -> None:
    """Add a tensor to the groups of a tensor-dict node. A group, ``[keys, dtype, shape,
    byte offset, byte step]``, is tensors of one dtype and shape at evenly spaced offsets
    that do not overlap (the columns of a put often are): the decoder builds all of them
    in one call. A tensor that aliases the one before it starts a group of its own."""
    if groups:
        g = groups[-1]
        if g[1] == dtype and g[2] == shape and at >= g[3] + max(nbytes, 1):
            if len(g[0]) == 1:
                g[4] = at - g[3]
            if at == g[3] + g[4] * len(g[0]):
                g[0].append(key)
                return
    groups.append([[key], dtype, shape, at, 0])


def encode(obj: Any, *, shared: bool = False) -> list[Buffer]:
    """Encode ``obj`` into frames: a msgpack header, then one frame per tensor or array.

    Accepted values: torch tensors of every dtype (0-d, empty and non-contiguous
    ones too; non-contiguous ones are made contiguous, a copy); jagged nested
    tensors (``layout=torch.jagged``); numpy arrays of bool, int, uint, float and
    complex dtypes; None, bool, int, float, str, bytes; lists, tuples and dicts
    with str keys, nested to any depth. A list whose items are all dense tensors
    of one dtype is packed into one frame (one copy) and comes back as a list
    of tensors with the same shapes.

    CUDA tensors are copied to host memory once, here; they come back on the CPU.

    Frames of contiguous CPU tensors are views of the tensors' memory: send them
    with ``copy=False`` and do not modify the tensors until the send completed.

    ``shared``: the frames will go through shared memory (ipc://, where the
    platform has it). Tensors whose storage lies in this process's shared memory
    then travel as one frame per storage, and each node names its byte offset.

    Raises:
        WireError: a value of any other type, naming its path (``$.meta[3]``).
    """
    enc = _Encoder(shared)
    try:
        tree = enc.value(obj)
        header = msgspec.msgpack.encode([MAGIC, len(enc.frames), tree])
    except _Refused as e:
        path = "$" + "".join(reversed(e.path))
        raise WireError(
            f"cannot encode `{path}`: {e.reason}; accepted: {ACCEPTED} "
            "(convert the value to one of these; rlferry never pickles)"
        ) from None
    except OverflowError as e:
        raise WireError(f"cannot encode: {e} (ints must fit in 64 bits)") from None
    return [header, *enc.frames]
