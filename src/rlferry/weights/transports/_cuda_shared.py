"""CUDA IPC for ``cuda_ipc``: exporting and opening GPU memory, and a receiver's tensors
offered to the sender to write into.

A storage travels as the fields of torch's own IPC rebuild (``_share_cuda_``), plain bytes
and ints, never pickled. The opening process maps it onto a GPU of its choice: the one
the memory lies on, or another of the host (CUDA enables peer access, NVLink or PCIe),
whose kernels then read or write it across.

Writes (zero copy, a receiver with tensors of its own, as a ``ShardedReceiver`` has): at
its setup the receiver offers, for each pushed tensor, the regions of it it wants and the
views of its own tensors they go to (:func:`export_targets`); the sender opens them onto
its GPU (:func:`open_targets`) and each push copies its tensors' regions there with one
grouped copy, by the sender's GPU, before it records the event the receiver waits on.
The receiver loads nothing. Every field from the wire is checked before use: a view that
reaches past the memory it names is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import WeightSyncError
from ._base import strided_view

__all__ = ["export_targets", "gpu_uuid", "open_shared", "open_targets", "share"]

_WIRE_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
)  # fmt: skip
_DTYPES = {str(d).removeprefix("torch."): d for d in _WIRE_DTYPES}


def share(buf: torch.Tensor | torch.UntypedStorage) -> list[Any]:
    """The fields another process opens ``buf``'s storage with (:func:`open_shared`)."""
    storage = buf if isinstance(buf, torch.UntypedStorage) else buf.untyped_storage()
    device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
    return [int(device), bytes(handle), int(size), int(offset), bytes(rc_handle), int(rc_offset),
            bytes(ev_handle) if ev_handle else b"", bool(ev_sync)]  # fmt: skip


def open_shared(fields: list[Any], device: int) -> torch.Tensor:
    """The storage ``fields`` name, mapped onto GPU ``device`` of this process, as bytes."""
    _, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = fields
    storage = torch.UntypedStorage._new_shared_cuda(
        int(device), bytes(handle), int(size), int(offset), bytes(rc_handle), int(rc_offset),
        bytes(ev_handle) if ev_handle else None, bool(ev_sync),
    )  # fmt: skip
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage)


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def export_targets(
    targets: list[list[tuple[tuple[slice, ...], torch.Tensor]]], device: torch.device
) -> dict[str, Any] | None:
    """A receiver's offer: for each pushed tensor ``i``, ``targets[i]`` lists a region of it
    and the view of the receiver's own tensor on ``device`` it goes to; None where one
    cannot be offered (another device, memory CUDA IPC cannot export)."""
    storages: list[list[Any]] = []
    index: dict[int, int] = {}
    writes: list[list[Any]] = []
    try:
        for i, entry in enumerate(targets):
            for region, dst in entry:
                if dst.device != device or dst.dtype not in _DTYPES.values():
                    return None
                st = dst.untyped_storage()
                at = index.get(st.data_ptr())
                if at is None:
                    at = index[st.data_ptr()] = len(storages)
                    storages.append(share(st))
                writes.append([
                    i, [[s.start, s.stop] for s in region], at,
                    dst.storage_offset() * dst.element_size(), list(dst.shape),
                    list(dst.stride()), str(dst.dtype).removeprefix("torch."),
                ])  # fmt: skip
    except RuntimeError:  # e.g. expandable segments: CUDA IPC cannot export them
        return None
    assert device.index is not None
    return {"storages": storages, "writes": writes, "uuid": gpu_uuid(device.index)}


def open_targets(
    desc: dict[str, Any], device: torch.device, tensors: int
) -> list[tuple[int, tuple[slice, ...], torch.Tensor]]:
    """A receiver's offer (:func:`export_targets`), opened onto the sender's ``device``:
    each (pushed tensor index, its region, the receiver's view it goes to). ``tensors``:
    how many tensors the push has."""
    try:
        fields = list(desc["storages"])
        writes = [
            (int(i), tuple(slice(int(a), int(b)) for a, b in region), int(at), int(off),
             [int(n) for n in shape], [int(s) for s in strides], _DTYPES[str(dtype)])
            for i, region, at, off, shape, strides, dtype in desc["writes"]
        ]  # fmt: skip
    except (KeyError, TypeError, ValueError):
        raise WeightSyncError("malformed acknowledgement: bad cuda_ipc targets") from None
    assert device.index is not None
    try:
        with torch.cuda.device(device):
            mem = [open_shared(f, device.index) for f in fields]
    except (RuntimeError, TypeError, ValueError) as e:
        raise WeightSyncError(
            f"cannot open the receiver's CUDA IPC memory on {device}: {e} (cuda_ipc needs the "
            "receiver on this host, on this GPU or one it reaches by peer access)"
        ) from None
    out: list[tuple[int, tuple[slice, ...], torch.Tensor]] = []
    for i, region, at, off, shape, strides, dtype in writes:
        if not (0 <= i < tensors and 0 <= at < len(mem) and 0 <= off <= mem[at].numel()):
            raise WeightSyncError(
                f"malformed acknowledgement: a cuda_ipc target of tensor {i} in storage {at} at "
                f"byte {off} (the push has {tensors} tensors, the offer {len(mem)} storages)"
            )
        name = f"target {len(out)} (of pushed tensor {i})"
        out.append((i, region, strided_view(mem[at][off:], name, shape, dtype, strides)))
    return out
