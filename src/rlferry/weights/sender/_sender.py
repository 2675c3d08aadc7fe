"""The sender: streams named tensors to the receivers of one group, bucket by bucket."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._config import SenderConfig
from .._report import PushReport, SenderStatistics
from ._again import Again
from ._deltas import DeltaPushes
from ._pusher import Pusher
from ._turns import drain

__all__ = ["WeightSender"]


def _cast(t: Any, dtype: torch.dtype) -> Any:
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
        return t.detach().to(dtype)
    return t


class WeightSender:
    """Streams named tensors to the receivers of one group, bucket by bucket.

    ``transport``: ``"shm"`` (CPU tensors, receivers on this host), ``"cuda_ipc"``
    (CUDA tensors, receivers on the same GPU) or ``"broadcast"`` (a
    ``torch.distributed`` group of the sender and its receivers: NCCL for CUDA
    tensors, gloo for CPU ones). ``receivers``: how many receivers the first
    push waits for; later pushes go to the receivers present (one that failed or
    left is dropped, one that joins is added). ``bucket_bytes``: the size of each
    of the two buffers (default: from free device memory). ``bind``: the control
    address (default: a fresh ipc:// path, or tcp://127.0.0.1 for broadcast);
    off-host binds need ``secret``. ``device``: where the buffers live (default:
    the first pushed tensor's device). ``zero_copy`` (cuda_ipc, shm): when the
    pushed tensors are contiguous and on the sender's device and the input is
    re-iterable (a ``state_dict().items()``), receivers read them where they are,
    through IPC handles (cuda_ipc) or mappings (shm) opened once while the same
    tensors are pushed again: no pack, no buffers. For shm the first such push
    moves the tensors' storages into shared memory, as ``share_memory_()`` does
    (same tensors, same values); later tensors that are not shared yet are
    packed. A generator, ``verify`` or other tensors fall back to packing.

    Two options exist for comparisons (the benchmark's rows), not for tuning:
    ``grouped_pack=False`` packs every bucket with one ``_foreach_copy_`` (per
    tensor) instead of one grouped copy for tensors pushed again at the same
    addresses (the default: one Triton launch on CUDA, one bulk host copy on
    CPU). ``nccl_high_priority=False`` (broadcast over NCCL) creates the group's
    NCCL streams, on the sender and on every receiver, at normal priority
    instead of high (the default: NCCL's kernels take SMs before the pack and
    load copies queued beside them, and the collective is what bounds a push).

    Delta pushes: ``delta_budget`` (bytes; 0: off) lets the sender keep the bytes of
    the version it pushed last, for the first tensors (in push order) that fit, beside
    the pushed tensors (``delta_base="device"``: the trainer's GPU, or ordinary memory
    for CPU tensors) or in pinned host memory (``"host"``). A later push whose every
    receiver committed that version and takes deltas (``WeightReceiver(deltas=...)``)
    sends only the elements that changed, bit for bit; a tensor that did not change is
    not sent, one that changed a lot goes dense, one not kept always goes dense. One
    receiver that lacks the base (new, rejoined, or one that failed a push since) makes
    the whole push full; so do ``push(..., full=True)``, the first push and a new
    layout. ``delta_policy="measured"`` (the default): whether deltas are faster on this
    link is measured, the sender timing both kinds and pushing the faster (a GPU's own
    copy outruns the diff; a host's TCP link is outrun by it); ``"always"``: every push
    that may be a delta is one. Over ``cuda_ipc`` the measured policy pushes full and
    keeps no base: the full push is one copy on the GPU, and the diff alone reads twice
    its bytes (five copies' time on an H200: ``python benchmarks/delta_diff.py --device
    cuda``). ``PushReport.kind`` says which each push was.

    A process may run one sender per group, each with its own transport.
    """

    def __init__(
        self,
        *,
        group: str,
        transport: str = "shm",
        receivers: int = 1,
        bucket_bytes: int | None = None,
        bind: str | None = None,
        device: Any = None,
        secret: str | bytes | None = None,
        zero_copy: bool = True,
        grouped_pack: bool = True,
        nccl_high_priority: bool = True,
        delta_budget: int = 0,
        delta_base: str = "device",
        delta_policy: str = "measured",
    ) -> None:
        self.config = SenderConfig(
            group=group,
            transport=transport,
            receivers=receivers,
            bucket_bytes=bucket_bytes,
            bind=bind,
            device=device,
            secret=secret,
            zero_copy=zero_copy,
            grouped_pack=grouped_pack,
            nccl_high_priority=nccl_high_priority,
            delta_budget=delta_budget,
            delta_base=delta_base,
            delta_policy=delta_policy,
        )
        self._pusher = Pusher(self.config)
        self._again = Again()  # the same tensors pushed again: started by this thread
        measured_loses = delta_policy == "measured" and transport == "cuda_ipc"
        self._deltas = (
            DeltaPushes(self._pusher, delta_budget, delta_base, delta_policy == "always")
            if delta_budget and not measured_loses
            else None
        )
        self.address: str = self._pusher.address

    def push(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        timeout: float = 60.0,
        layout: Iterable[tuple[str, Any]] | None = None,
        full: bool = False,
        dtype: torch.dtype | None = None,
    ) -> PushReport:
        """Send every ``(name, tensor)`` to the group's receivers; returns when they committed.

        ``named_tensors``: a ``state_dict()`` or its ``.items()``, a list, or a
        generator (one that gathers FSDP shards per bucket, say): tensors are packed in
        order as they come. A re-iterable input is read once for its layout first; a
        generator streams against the previous push's layout (its first push, or
        a layout change, needs ``layout=``: the names with anything that has
        ``.shape`` and ``.dtype``, else the generator is read whole first). A push of
        the tensors the last push sent, where they lay (same names, shapes, addresses,
        strides and dtypes: a trainer's parameters step after step), is not checked
        again and, read in place by its receivers, is started by the calling thread.

        A push goes to the receivers ready when it starts: the first waits for
        ``receivers`` of them, later ones for one (and for a receiver that just
        joined to ask for work, a moment at most); a receiver still busy with an
        earlier push, or one that joined and never asked for work, is left out.

        ``dtype``: cast every floating-point tensor to it first (the dtype the engines
        serve: deltas are exact in it). ``full``: a sender with ``delta_budget`` pushes
        every tensor, not a delta (a full push needs no base at the receivers).

        Raises:
            PushTimeout: (a ``TimeoutError``) too few receivers were ready within
                ``timeout`` (the message names each one that joined and what it was
                doing), or some did not acknowledge in time (``failures`` names them,
                ``report`` says who committed).
            WeightSyncError: a receiver rejected the plan (nothing moved) or failed
                (``failures`` names each with its reason; the others committed,
                ``report`` says who).
            DeltaBaseMissing: (a ``WeightSyncError`` and a ``ValueError``) a receiver
                refused a delta push before any byte moved: it does not hold the base
                version (its next push is full).
            SenderClosed: the sender was closed.
            ValueError: ``version`` is not an int.
        """
        if isinstance(named_tensors, Mapping):  # a state_dict() itself: its pairs
            named_tensors = named_tensors.items()
        if dtype is not None:
            named_tensors = [(n, _cast(t, dtype)) for n, t in named_tensors]
        if self._deltas is None:
            named = self._again.named(named_tensors)
            try:
                return drain(self._pusher.steps(named, version, timeout, layout))
            except BaseException:
                self._again.forget()
                raise
        return self._deltas.push(list(named_tensors), version, timeout, full)

    def statistics(self) -> SenderStatistics:
        stats = self._pusher.statistics()
        if self._deltas is None:
            return stats
        return dataclasses.replace(stats, **self._deltas.statistics())

    def close(self) -> None:
        """Stop serving; receivers see the sender gone and keep their last version."""
        self._pusher.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
