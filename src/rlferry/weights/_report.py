"""Frozen records: what a push did, and what a sender or receiver has done so far."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "PushReport",
    "ReceiverStatistics",
    "SenderStatistics",
    "ShardedReceiverStatistics",
    "ShardedSenderStatistics",
]


@dataclass(frozen=True)
class PushReport:
    """One push: ``bytes`` of tensor data moved to each receiver in ``seconds``.

    ``receivers`` names the receivers that committed ``version``; ``plan_sent``
    says whether the layout travelled (first push, a new layout or a new receiver).
    ``kind``: ``"full"``, or ``"delta"`` (a sender with ``delta_budget``: only what
    changed since the base version was sent); ``sent_bytes``: what moved (``bytes``);
    ``full_bytes``: what a full push of the same tensors moves; ``changed``: the
    fraction of the compared elements that changed (None: a full push compares none).
    ``tensors`` and ``buckets`` count what moved (a delta push's encoded tensors).
    """

    version: int
    bytes: int
    seconds: float
    receivers: tuple[str, ...]
    tensors: int
    buckets: int
    plan_sent: bool
    kind: str = "full"
    sent_bytes: int = -1  # -1: ``bytes``
    full_bytes: int = -1  # -1: ``bytes``
    changed: float | None = None

    def __post_init__(self) -> None:
        for name in ("sent_bytes", "full_bytes"):
            if getattr(self, name) < 0:
                object.__setattr__(self, name, self.bytes)


@dataclass(frozen=True)
class SenderStatistics:
    """A sender's counters. ``buffer_bytes``: its bucket buffers together."""

    group: str
    transport: str
    address: str
    receivers: int
    pushes: int
    failed_pushes: int
    bytes_pushed: int
    last_push_seconds: float
    bucket_bytes: int
    buffer_bytes: int
    plans_sent: int
    groups_formed: int
    # pushes whose receivers were started on their start lines (a collective's streams; a
    # mailbox push started by the pushing thread alone: its every bucket announced there)
    started_on_lines: int = 0
    # mailbox pushes this thread started alone, no hop to the wire loop (their receivers
    # committed the last push, hold its plan and read the tensors in place)
    started_here: int = 0
    # mailbox pushes that ended on their receivers' word on the commit line (see _line)
    commits_on_line: int = 0
    # delta pushes: the bytes kept of the base version (within delta_budget), and the
    # pushes that were deltas
    delta_bytes: int = 0
    delta_pushes: int = 0


@dataclass(frozen=True)
class ReceiverStatistics:
    """A receiver's counters. ``buffers_opened`` counts buffer mappings (shm) or
    IPC handles (cuda_ipc) it opened: once per layout, not once per push.
    ``last_error``: the last push it failed, and why. ``stopped``: None while it
    serves; else why it serves no more (closed, the sender gone, its thread failed).
    ``buffer_bytes``: the bucket buffers it made (broadcast; shm and cuda_ipc map the
    sender's, counted by the sender's statistics). ``bytes_written``: what a cuda_ipc
    sender wrote into this receiver's own tensors (zero copy to a ShardedReceiver's link,
    whose ``bytes_loaded`` then stays 0)."""

    group: str
    name: str
    version: int | None
    commits: int
    failures: int
    bytes_loaded: int
    last_push_seconds: float
    buffers_opened: int
    groups_joined: int
    last_error: str | None
    stopped: str | None = None
    buffer_bytes: int = 0
    bytes_written: int = 0


@dataclass(frozen=True)
class ShardedSenderStatistics:
    """A trainer rank's sharded sender. ``plans_computed``: how many times it computed
    the plan (once per pair of layouts); ``stream_bytes``: what it sends per update (what
    it owns that some receiver needs, each byte once; point to point, what its links
    carry); ``link``: its WeightSender's (``per_receiver``: point to point, each one's)."""

    rank: int
    plan: str
    plans_computed: int
    pieces: int
    stream_bytes: int
    receivers: tuple[int, ...]
    link: SenderStatistics | None  # the shared stream's sender (None point to point)
    per_receiver: dict[int, SenderStatistics]  # point to point: each engine rank's link


@dataclass(frozen=True)
class ShardedReceiverStatistics:
    """An engine rank's sharded receiver. ``version``: the last version every sender's
    part of arrived and loaded; ``links``: per trainer rank, its WeightReceiver's
    statistics; ``failures``: per trainer rank, why its part of an update failed, while
    it has not committed since."""

    rank: int
    name: str
    version: int | None
    plan: str
    plans_computed: int
    needed_bytes: int
    links: dict[int, ReceiverStatistics]
    failures: dict[int, str]
