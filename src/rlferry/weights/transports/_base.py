"""The transport interface: what the sender and a receiver call on each kind of transport.

*Mailbox* transports (shm, cuda_ipc: :class:`MailboxSender`,
:class:`MailboxReceiver`) keep two bucket buffers that the sender packs into
and every receiver maps once; the sender announces each bucket in a control
message and reuses a buffer when every receiver acknowledged it. Both offer
*zero copy*: when the pushed tensors can be shared as they are, receivers read
them in place (``use_direct``) and nothing is packed.

*Collective* transports (broadcast: :class:`CollectiveSender`,
:class:`CollectiveReceiver`) move every bucket with one collective call per
bucket through a group of the sender and its receivers; the control messages
only form the group, start the stream and collect the results.

The sender and the receiver tell the kinds apart with ``isinstance`` and call
nothing outside these classes.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from rlferry.errors import RequestError

from .._errors import WeightSyncError

if TYPE_CHECKING:
    from ..planning._buckets import Plan
    from ..protocol._messages import StoreOp, StoreReply
    from ._rendezvous import KeyValue

__all__ = [
    "BucketBuffers",
    "CollectiveReceiver",
    "CollectiveSender",
    "MailboxReceiver",
    "MailboxSender",
    "ReceiverTransport",
    "SenderTransport",
    "checksum",
    "direct_place",
    "direct_views",
    "strided_view",
]


def checksum(view: torch.Tensor) -> int:
    """The wrapping sum of the 8-byte words of ``view`` (uint8, length a multiple of 8)."""
    return int(view.view(torch.int64).sum().item())


def direct_place(t: torch.Tensor, storage: int) -> list[Any]:
    """Zero copy: where a pushed tensor lies in its exported ``storage`` (an index), for the
    descriptor: ``[storage, byte offset]``, and its strides (in elements) where it is not
    contiguous (a trainer rank's columns of a row-parallel weight, read where they lie)."""
    place: list[Any] = [storage, int(t.storage_offset()) * t.element_size()]
    if not t.is_contiguous():
        place.append([int(s) for s in t.stride()])
    return place


def direct_views(
    desc: dict[str, object], storages: list[torch.Tensor], what: str
) -> tuple[list[torch.Tensor], list[list[int] | None]]:
    """A zero-copy descriptor's ``tensors``, in the receiver's mapped ``storages`` (bytes):
    each one's bytes from its first element, and its strides (None where contiguous; an
    empty tensor is storage -1); a malformed entry raises naming ``what`` (the
    transport)."""
    empty = torch.empty(0, dtype=torch.uint8)
    views: list[torch.Tensor] = []
    strides: list[list[int] | None] = []
    try:
        for p in desc["tensors"]:  # type: ignore[attr-defined]
            st = [int(x) for x in p[2]] if len(p) == 3 else None
            if len(p) not in (2, 3) or (st is not None and min(st, default=0) < 0):
                raise RequestError(p)
            i, at = int(p[0]), int(p[1])
            views.append(storages[i][at:] if i >= 0 else empty)
            strides.append(st)
    except (KeyError, TypeError, ValueError, IndexError):
        raise WeightSyncError(f"malformed setup: bad {what} tensors") from None
    return views, strides


def strided_view(
    raw: torch.Tensor, name: str, shape: Sequence[int], dtype: torch.dtype,
    strides: Sequence[int] | None,
) -> torch.Tensor:  # fmt: skip
    """Zero copy: tensor ``name`` of ``shape`` and ``dtype`` in another process's bytes
    ``raw`` (uint8, from its first element), at ``strides`` (elements) or contiguous;
    strides that reach past the bytes given are refused, naming the tensor."""
    shape = [int(n) for n in shape]
    if strides is None:
        reach = math.prod(shape) * dtype.itemsize
    else:
        if len(strides) != len(shape):
            raise WeightSyncError(
                f"malformed setup: tensor `{name}`: {len(strides)} strides for shape {shape}"
            )
        last = sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
        reach = (last + 1) * dtype.itemsize if math.prod(shape) else 0
    if reach > raw.numel():
        raise WeightSyncError(
            f"malformed setup: tensor `{name}` reaches {reach} bytes, the memory shared "
            f"holds {raw.numel()} from it"
        )
    flat = raw[:reach].view(dtype)
    return flat.view(shape) if strides is None else flat.as_strided(shape, list(strides))


class BucketBuffers(Protocol):
    """What a packer packs into: two bucket buffers of one ``generation``.

    ``collective``: the packs run beside a collective (their copies take a
    bounded grid, leaving the collective its SMs)."""

    @property
    def generation(self) -> int: ...

    @property
    def collective(self) -> bool: ...

    def buffer(self, b: int) -> torch.Tensor: ...


# -- the sender's side ---------------------------------------------------------------------------


class SenderTransport(abc.ABC):
    """The sender's side of a transport; one per sender.

    ``generation`` bumps whenever the buffers (or the group, or the zero-copy
    tensors) change: receivers attached to an older one must attach again.
    """

    name: ClassVar[str] = ""
    collective: ClassVar[bool] = False
    generation: int = 0
    groups_formed: int = 0  # collective: groups formed, ever

    @abc.abstractmethod
    def prepare(self, nbytes: int, device: torch.device) -> None:
        """Have two buffers of at least ``nbytes`` on ``device`` (none while zero copy)."""

    @abc.abstractmethod
    def buffer(self, b: int) -> torch.Tensor:
        """Buffer ``b`` (0 or 1) as bytes: the packer writes bucket ``k`` into ``k % 2``."""

    @property
    @abc.abstractmethod
    def buffer_bytes(self) -> int:
        """The bytes its buffers take together."""

    def receiver_left(self, key: bytes) -> None:  # noqa: B027 (a no-op unless overridden)
        """A receiver is gone or joined again: forget what it sent."""

    def deadline_passed(self) -> None:  # noqa: B027 (a no-op unless overridden)
        """On the wire loop, at the deadline of the push in progress: end whatever of it
        waits without a bound of its own."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the buffers (or leave the group); the sender is closing."""


class MailboxSender(SenderTransport):
    """Two buffers in memory the receivers map (shm, cuda_ipc), or zero copy.

    Per push the sender calls ``use_direct`` (the input is re-iterable, zero
    copy is on, no verify) or ``use_packed``, then ``prepare``; a receiver
    that must attach gets ``descriptor()``; its answer comes to
    ``receiver_attached``. Zero copy: ``ready()``, then every bucket is
    announced at once. Packed: per bucket ``before_pack``, the pack into
    ``buffer(k % 2)``, ``after_pack``.
    """

    collective: ClassVar[bool] = False
    direct: bool = False  # this push is zero copy: receivers read the pushed tensors in place

    @abc.abstractmethod
    def use_direct(self, tensors: list[torch.Tensor], device: torch.device) -> bool:
        """Let receivers read ``tensors`` where they are, if they all can be; True if so
        (``direct`` is then True). While the same tensors come again nothing is exported anew."""

    @abc.abstractmethod
    def use_packed(self) -> None:
        """This push is packed into the buffers (a generator, verify, or zero copy off)."""

    @abc.abstractmethod
    def ready(self, tensors: list[torch.Tensor], keys: list[bytes]) -> None:
        """Zero copy: the pushed ``tensors`` hold this push's values (cuda_ipc: writes them
        into the tensors of this push's receivers ``keys`` that offered theirs, then records
        the event the receivers wait on); called before the buckets are announced."""

    def abandon(self) -> None:
        """The push that called ``use_direct`` or ``use_packed`` failed before any bucket
        moved (a receiver rejected the plan, say): forget what it alone allowed."""

    @abc.abstractmethod
    def descriptor(self) -> dict[str, object]:
        """What a receiver needs to attach to the current buffers or tensors (plain data)."""

    def receiver_attached(
        self, key: bytes, handles: list[bytes], targets: dict[str, Any] | None = None
    ) -> None:
        """A receiver attached; ``handles`` are what it sent back (cuda_ipc: its events) and
        ``targets`` the tensors it offers to be written into (cuda_ipc, zero copy: see
        :meth:`MailboxReceiver.offer`)."""

    def before_pack(self, b: int, keys: list[bytes]) -> None:
        """Buffer ``b`` is free on the CPU's side; order the pack after the reads of the
        receivers ``keys``."""

    def after_pack(self, b: int) -> None:
        """The pack of buffer ``b`` is issued; let the receivers order their reads after it."""


class CollectiveSender(SenderTransport):
    """A group of the sender (rank 0) and its receivers; one collective per bucket.

    Per push the sender calls ``group_for`` (a descriptor per receiver when the
    group must be formed anew, else None; ``current`` for a receiver that only
    needs the plan), ``prepare``, ``form`` once the descriptors went out, then
    ``stream``. A push that fails calls ``broken``.
    """

    collective: ClassVar[bool] = True
    kv: KeyValue | None = None  # the rendezvous pairs the sender's control channel serves
    max_ctas: int = 0  # NCCL thread blocks the next group may take, at every member (0: NCCL's)

    @abc.abstractmethod
    def group_for(
        self, keys: list[bytes], timeout: float, device: torch.device
    ) -> dict[bytes, dict[str, Any]] | None:
        """A descriptor per receiver ``keys`` when the group must be (re)formed, else None."""

    @abc.abstractmethod
    def has_group(self, keys: list[bytes]) -> bool:
        """Whether the group is formed with exactly these receivers (in this order): a push to
        them needs no setup (read on the wire loop, while the pushing thread waits)."""

    @abc.abstractmethod
    def current(self, key: bytes) -> dict[str, Any]:
        """The descriptor of the current group, for receiver ``key`` (already a member)."""

    @abc.abstractmethod
    def form(self, deadline: float) -> None:
        """Join the group being formed as rank 0 (blocks until every receiver joined)."""

    @abc.abstractmethod
    def stream(
        self,
        plan: Plan,
        buckets: Iterator[tuple[int, list[Any]]],
        packer: Any,
        verify: bool,
        deadline: float,
        packed: bool = False,
    ) -> Generator[bool | None, None, bool]:
        """Pack and send every bucket (then the checksums if ``verify``), a step each (a
        generator: the caller drives it, see ``WeightSender._steps``); ``packed``: bucket 0
        is in buffer 0 already; a step yields True when the next one blocks until the
        buckets went. Returns whether every receiver said it committed
        (:meth:`CollectiveReceiver.tell`); False: one failed, its ack says why. Raises
        ``WeightSyncError`` if the group broke."""

    @abc.abstractmethod
    def broken(self) -> None:
        """A push failed: drop the group; the next push forms it anew."""


# -- a receiver's side ---------------------------------------------------------------------------


class ReceiverTransport(abc.ABC):
    """A receiver's side of a transport; made when it joins (the sender names the kind)."""

    opened: int = 0  # buffers mapped, IPC handles opened or bucket buffers made, ever
    groups_joined: int = 0  # collective: groups joined, ever

    @property
    def buffer_bytes(self) -> int:
        """The bucket buffers this receiver made (a collective's own; a mailbox maps the
        sender's, which its statistics count)."""
        return 0

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap the buffers (or leave the group)."""


class MailboxReceiver(ReceiverTransport):
    """Maps the sender's two buffers (or, zero copy, its tensors) and loads from them.

    Per plan: ``attach``; then per bucket ``before_load``, the load (on
    ``load_stream`` when there is one), ``after_load``; ``finish`` before the
    commit.
    """

    direct: bool = False  # attached to the sender's own tensors (zero copy), not to buffers
    tensors: list[torch.Tensor]  # zero copy: the bytes of each pushed tensor, from its first
    strides: list[list[int] | None]  # zero copy: each one's strides, None where contiguous

    @abc.abstractmethod
    def attach(self, desc: dict[str, object], device: torch.device | None) -> list[bytes]:
        """Map what ``desc`` names (once: cached); returns what the sender needs back."""

    @abc.abstractmethod
    def buffer(self, b: int) -> torch.Tensor:
        """Buffer ``b`` (0 or 1), as bytes."""

    def offer(self, targets: list[list[tuple[tuple[slice, ...], torch.Tensor]]]) -> Any:
        """Zero copy: offer the sender this receiver's tensors to write each pushed tensor
        into (``targets[i]``: tensor i's regions and where each goes), instead of loading
        them itself; what the sender needs to write there, or None where this transport
        cannot (the receiver then loads)."""
        return None

    @property
    def load_stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream loads are issued on (cuda_ipc), or None."""
        return None

    def before_load(self, b: int) -> None:
        """Order the load of buffer ``b`` after the sender's pack."""

    def after_load(self, b: int) -> None:
        """The load of buffer ``b`` is issued; let the sender order its next pack after it."""

    def finish(self) -> None:
        """Wait until every issued load has completed (before a commit)."""


class CollectiveReceiver(ReceiverTransport):
    """A receiver's rank in the sender's group, with its two bucket buffers."""

    @abc.abstractmethod
    def join(
        self, desc: dict[str, Any], host: str, device: torch.device | None,
        call: Callable[[StoreOp], StoreReply],
    ) -> None:  # fmt: skip
        """Join the group ``desc`` names (nothing to do if already in it); ``host``: the
        sender's; ``call``: a rendezvous store operation sent over the control channel."""

    @abc.abstractmethod
    def buffers(self, nbytes: int) -> list[torch.Tensor]:
        """The two bucket buffers, of at least ``nbytes`` (made once, grown when needed)."""

    @abc.abstractmethod
    def stream(
        self, plan: Plan, on_bucket: Callable[[int, torch.Tensor], None], verify: bool
    ) -> str | None:
        """Receive every bucket, calling ``on_bucket`` on each; the first error, or None."""

    @abc.abstractmethod
    def tell(self, committed: bool) -> None:
        """After a stream that did not break: whether this receiver committed it (the
        sender's push ends on every receiver's word; their acks follow on the control
        channel)."""

    @abc.abstractmethod
    def aborter(self) -> Callable[[], None] | None:
        """What ends a :meth:`stream` in progress at once from another thread (it then
        returns its error), or None where the stream's waits end by themselves when a
        peer goes."""

    @abc.abstractmethod
    def leave(self) -> None:
        """Leave the group (its peers' pending operations fail)."""
