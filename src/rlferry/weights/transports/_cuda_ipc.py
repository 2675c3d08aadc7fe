"""``cuda_ipc``: a trainer's GPU memory read by engine processes on the same host.

The sender allocates two buffers and exports their CUDA IPC handles once per
layout; each receiver opens them once (cached) and reads every bucket where
the sender packed it: no per-step handle opening. Zero copy (the default where
the pushed tensors can be exported): receivers read the trainer's own tensors,
views of any strides, and nothing is packed. Ordering stays on the GPU:
the sender records an interprocess event after packing a buffer and each
receiver's load stream waits on it; each receiver records its own event after
issuing its load, and the sender's stream waits on those before packing that
buffer again. Neither CPU waits for the GPU until the receiver's commit.

A receiver on another GPU of the host opens the handles onto its own GPU (CUDA
maps the memory there and enables peer access, NVLink or PCIe) and its loads read
the trainer's memory across: one pass over the bytes, by the engine's GPU, with
no NCCL group and no buffer at either end. GPUs are matched by UUID, not index:
the two processes may see different ``CUDA_VISIBLE_DEVICES`` (Ray gives each actor
its own). Handle fields travel as plain bytes and ints (torch's own IPC rebuild,
fed from our message), never pickled.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import WeightSyncError
from ..copies._copy import GroupedCopy
from ._base import MailboxReceiver, MailboxSender, direct_place, direct_views
from ._cuda_shared import export_targets, gpu_uuid, open_shared, open_targets, share

__all__ = ["CudaIpcReceiver", "CudaIpcSender"]


def _local_index(uuid: object, index: int) -> int | None:
    """This process's index of the sender's GPU, found by its UUID (both sides may see
    different ``CUDA_VISIBLE_DEVICES``: a Ray actor sees only its own GPUs), or None
    where this process does not see it."""
    if uuid is None:  # a sender without UUIDs: its index, as this process numbers GPUs
        return index
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    return None


class CudaIpcSender(MailboxSender):
    name = "cuda_ipc"

    def __init__(self) -> None:
        self._device: torch.device | None = None
        self._bufs: list[torch.Tensor] = []
        self._packed: list[torch.cuda.Event] = []
        self._shared: list[list[Any]] = []
        self._consumed: dict[bytes, list[torch.cuda.Event]] = {}
        self.direct = False
        self._held: list[torch.Tensor] = []  # the last direct push's tensors, kept alive
        self._ptrs: list[int] = []
        self._direct_desc: dict[str, object] = {}
        # zero copy into receivers' tensors: by receiver, where each pushed tensor's regions
        # go (their memory opened onto this GPU), and the copy that writes them there
        self._targets: dict[bytes, list[tuple[int, tuple[slice, ...], torch.Tensor]]] = {}
        self._writes: dict[bytes, tuple[list[int], GroupedCopy]] = {}
        self._write_stream: torch.cuda.Stream | None = None
        self._retired: list[Any] = []  # targets let go of, until the writes finished with them

    def _events(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise WeightSyncError(
                f"transport 'cuda_ipc': expected CUDA tensors, got device {str(device)!r} "
                "(use transport 'shm' for CPU tensors)"
            )
        if self._device == device:
            return
        with torch.cuda.device(device):
            self._packed = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            for ev in self._packed:
                ev.record()
        self._device = device
        self._consumed = {}

    def prepare(self, nbytes: int, device: torch.device) -> None:
        self._events(device)
        if self.direct:
            return
        if self._bufs and self._bufs[0].device == device and self._bufs[0].numel() >= nbytes:
            return
        self._bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self._shared = [share(b) for b in self._bufs]
        self._consumed = {}
        self.generation += 1

    def use_direct(self, tensors: list[torch.Tensor], device: torch.device) -> bool:
        """Let receivers read ``tensors`` where they are (no pack), if they all can be:
        on ``device`` (views of any strides), in memory that CUDA IPC can export. Their storages
        are exported once and kept alive while they are pushed again; a push of other
        tensors exports anew (the receivers attach again)."""
        self._events(device)
        ptrs = [t.data_ptr() for t in tensors]
        if self.direct and ptrs == self._ptrs:
            self._held = tensors
            return True
        ok = all(t.device == device for t in tensors)
        desc: dict[str, object] = {}
        if ok:
            try:
                desc = self._export(tensors)
            except RuntimeError:  # e.g. expandable segments: CUDA IPC cannot export them
                ok = False
        if ok != self.direct or ok:
            self.generation += 1
        self.direct, self._direct_desc = ok, desc
        self._held, self._ptrs = (tensors, ptrs) if ok else ([], [])
        if ok:
            self._bufs, self._shared = [], []  # the packing buffers are not needed
        return ok

    def use_packed(self) -> None:
        """This push is packed into the buffers (a generator, verify, or zero_copy off)."""
        if self.direct:
            self.direct, self._held, self._ptrs, self._direct_desc = False, [], [], {}
            self.generation += 1

    def _export(self, tensors: list[torch.Tensor]) -> dict[str, object]:
        index: dict[int, int] = {}
        storages: list[list[Any]] = []
        places: list[list[int]] = []
        for t in tensors:
            st = t.untyped_storage()
            at = index.get(st.data_ptr())
            if at is None:
                at = index[st.data_ptr()] = len(storages)
                storages.append(share(st))
            places.append(direct_place(t, at))
        return {"mode": "direct", "storages": storages, "tensors": places}

    def descriptor(self) -> dict[str, object]:
        assert self._device is not None
        events = {
            "events": [bytes(ev.ipc_handle()) for ev in self._packed],
            "device": self._device.index,
            "uuid": gpu_uuid(self._device.index),
        }
        if self.direct:  # and receivers may offer their tensors to be written into
            return {**self._direct_desc, **events, "writes": True}
        return {"buffers": self._shared, **events}

    def ready(self, tensors: list[torch.Tensor], keys: list[bytes]) -> None:
        """Direct mode: the pushed tensors are complete on the current stream. Each receiver
        of this push (``keys``) that offered its tensors gets them written there, by this
        GPU, on a stream of the sender's own (each link of a rank on its own stream: two
        links' writes side by side take 6.2 ms where one after the other take 7.4: ``python
        benchmarks/weights_sharded.py --device cuda --point-to-point --senders 2 --receivers
        2 --scale 2 --transport cuda_ipc --gpus 4`` on four H100s); the event the receivers
        wait on follows the writes. A receiver not in the
        push is not written (it may be serving)."""
        assert self._device is not None
        stream = torch.cuda.current_stream(self._device)
        writes = [w for w in map(self._write_copy, keys, [tensors] * len(keys)) if w is not None]
        if writes or self._retired:
            if self._write_stream is None:
                self._write_stream = torch.cuda.Stream(self._device)
            self._release()
            self._write_stream.wait_stream(stream)
            stream = self._write_stream
            with torch.cuda.stream(stream):
                for write in writes:
                    write()
        self._packed[0].record(stream)

    def _release(self) -> None:
        """Let go of the targets of receivers that left or attached anew, once the writes
        stream finished with them (their memory is unmapped when the last view goes: a
        write still running there would fault)."""
        n = len(self._retired)
        if n:
            assert self._write_stream is not None
            self._write_stream.synchronize()
            del self._retired[:n]  # the wire loop may append meanwhile: those stay

    def _retire(self, key: bytes) -> None:
        """Receiver ``key``'s targets and copy go (from any thread): kept until released."""
        gone = (self._targets.pop(key, None), self._writes.pop(key, None))
        if any(g is not None for g in gone):
            self._retired.append(gone)

    def _write_copy(self, key: bytes, tensors: list[torch.Tensor]) -> GroupedCopy | None:
        """The copy of ``tensors``' regions into receiver ``key``'s tensors (None: it offered
        none, or left): built once, and again when the pushed tensors lie elsewhere."""
        ptrs = self._ptrs
        kept = self._writes.get(key)
        if kept is not None and kept[0] is ptrs:
            return kept[1]
        targets = self._targets.get(key)
        if targets is None:
            return None
        dsts, srcs = [], []
        for i, region, dst in targets:
            src = tensors[i][region]
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise WeightSyncError(
                    f"cuda_ipc: a receiver offered {list(dst.shape)} {dst.dtype} for a region "
                    f"of pushed tensor {i} of {list(src.shape)} {src.dtype} (a bug)"
                )
            dsts.append(dst)
            srcs.append(src)
        sms = torch.cuda.get_device_properties(self._device).multi_processor_count
        # a bounded grid: 2 programs an SM write a rank's two links in 6.2 ms, a program a
        # tile (the whole GPU) in 8.5 (2 -> 2 at 4.1 GB, the command of ``ready``)
        copy = GroupedCopy(dsts, srcs, programs=2 * sms)
        self._writes[key] = (ptrs, copy)
        return copy

    def buffer(self, b: int) -> torch.Tensor:
        return self._bufs[b]

    def receiver_attached(
        self, key: bytes, handles: list[bytes], targets: dict[str, Any] | None = None
    ) -> None:
        if len(handles) != 2:
            raise WeightSyncError("malformed acknowledgement: expected 2 event handles")
        assert self._device is not None
        self._consumed[key] = [torch.cuda.Event.from_ipc_handle(self._device, h) for h in handles]
        self._retire(key)
        if targets is not None and self.direct:
            self._targets[key] = open_targets(targets, self._device, len(self._ptrs))

    def receiver_left(self, key: bytes) -> None:
        self._consumed.pop(key, None)
        self._retire(key)

    def before_pack(self, b: int, keys: list[bytes]) -> None:
        stream = torch.cuda.current_stream(self._bufs[b].device)
        for key in keys:
            events = self._consumed.get(key)
            if events is not None:
                stream.wait_event(events[b])

    def after_pack(self, b: int) -> None:
        self._packed[b].record(torch.cuda.current_stream(self._bufs[b].device))

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self._bufs)

    def close(self) -> None:
        if self._write_stream is not None:
            self._write_stream.synchronize()
        self._bufs, self._packed, self._consumed, self._held = [], [], {}, []
        self._targets, self._writes, self._retired = {}, {}, []


class CudaIpcReceiver(MailboxReceiver):
    def __init__(self) -> None:
        self._key: tuple[object, ...] = ()
        self._bufs: list[torch.Tensor] = []
        self._packed: list[torch.cuda.Event] = []
        self._consumed: list[torch.cuda.Event] = []
        self._stream: torch.cuda.Stream | None = None
        self.direct = False
        self.tensors: list[torch.Tensor] = []  # direct mode: each pushed tensor's bytes
        self.strides: list[list[int] | None] = []  # direct mode: and its strides
        self.writable = False  # the sender writes into the tensors a receiver offers

    def attach(self, desc: dict[str, object], device: torch.device | None) -> list[bytes]:
        try:
            self.direct = desc.get("mode") == "direct"
            shared: list[list[Any]] = desc["storages" if self.direct else "buffers"]  # type: ignore[assignment]
            events = [bytes(h) for h in desc["events"]]  # type: ignore[attr-defined]
            index = int(desc["device"])  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError):
            raise WeightSyncError("malformed setup: bad cuda_ipc buffers") from None
        theirs = _local_index(desc.get("uuid"), index)
        dev = self._device_for(device, theirs, desc.get("uuid"))
        key = (dev.index, *(bytes(s[1]) + bytes(str(s[3]), "ascii") for s in shared), *events)
        if key != self._key:
            try:
                with torch.cuda.device(dev):
                    self._bufs = [open_shared(s, dev.index) for s in shared]
                    self._packed = [torch.cuda.Event.from_ipc_handle(dev, h) for h in events]
            except RuntimeError as e:
                raise WeightSyncError(
                    f"cannot open the sender's CUDA IPC memory on {dev}: {e} (cuda_ipc needs the "
                    "sender on this host, on this GPU or one this GPU reaches by peer access; "
                    "use 'broadcast' otherwise)"
                ) from None
            self._key = key
            self.opened += len(self._bufs)
        if self.direct:
            self.tensors, self.strides = direct_views(desc, self._bufs, "cuda_ipc")
        self.writable = self.direct and desc.get("writes") is True
        with torch.cuda.device(dev):
            self._stream = torch.cuda.Stream(dev)
            self._consumed = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            for ev in self._consumed:
                ev.record(self._stream)
        return [bytes(ev.ipc_handle()) for ev in self._consumed]

    def offer(self, targets: list[list[tuple[tuple[slice, ...], torch.Tensor]]]) -> Any:
        if not self.writable:  # a sender that does not write: this receiver loads
            return None
        assert self._stream is not None
        return export_targets(targets, self._stream.device)

    @staticmethod
    def _device_for(device: torch.device | None, theirs: int | None, uuid: object) -> torch.device:
        """The GPU this receiver opens the sender's memory onto and loads on: its own
        (``device``), reading the sender's GPU across where that is another one; without
        a device, the sender's GPU."""
        if device is None:
            if theirs is None:
                raise WeightSyncError(
                    f"transport 'cuda_ipc': the sender's GPU (UUID {uuid}) is not visible to "
                    "this receiver, which was given no device (give it its GPU: "
                    "device='cuda:N')"
                )
            return torch.device("cuda", theirs)
        if device.type != "cuda":
            raise WeightSyncError(
                f"transport 'cuda_ipc': expected a CUDA device for this receiver, got "
                f"{str(device)!r} (use transport 'shm' for CPU tensors)"
            )
        dev = torch.device("cuda", device.index if device.index is not None else 0)
        if (
            theirs is not None
            and theirs != dev.index
            and not torch.cuda.can_device_access_peer(dev.index, theirs)
        ):
            raise WeightSyncError(
                f"transport 'cuda_ipc': this receiver's {dev} cannot reach the sender's "
                f"cuda:{theirs} by peer access (no NVLink or PCIe peer path between them; "
                "use 'broadcast')"
            )
        return dev

    @property
    def load_stream(self) -> torch.cuda.Stream | None:
        return self._stream

    def buffer(self, b: int) -> torch.Tensor:
        return self._bufs[b]

    def before_load(self, b: int) -> None:
        assert self._stream is not None
        self._stream.wait_event(self._packed[0 if self.direct else b])

    def after_load(self, b: int) -> None:
        assert self._stream is not None
        self._consumed[b].record(self._stream)

    def finish(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        self.finish()
        self._bufs, self._packed, self._consumed = [], [], []
        self._key = ()
