"""What a sender knows of each receiver (:class:`Member`) and of the push in progress
(:class:`Push`): kept by its hub on the wire loop, read by the pushing thread."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from ._messages import ABORTED, DONE, IDLE, Join

__all__ = ["Member", "Push"]


class Member:
    """One receiver, as the sender sees it."""

    def __init__(self, key: bytes, join: Join) -> None:
        self.key = key
        self.name = join.name
        self.where = f"pid {join.pid} on {join.host}"
        self.pid = join.pid
        self.verify = join.verify
        self.deltas = join.deltas  # how it takes delta pushes ("": it takes none)
        self.holds: int | None = None  # the version it holds whole, by its last word
        self.line = ""  # its start line, if this sender reached it (see _line)
        self.parked: asyncio.Future[Any] | None = None
        self.watch: asyncio.Future[Any] | None = None  # its Watch, parked (see _messages)
        self.watch_seen = 0  # that Watch's ``seen``
        self.plan = ""  # fingerprint of the plan it holds
        self.generation = -1  # of the transport buffers (or group) it attached
        self.seq = 0  # the push it takes part in
        self.step = IDLE
        self.want: int | None = None
        self.error: str | None = None
        self.gone = False
        self.sent_setup = False
        self.fresh = True  # joined, its first request not parked yet
        self.awaited = True  # fresh, and pushes still wait for it (JOIN_GRACE after joining)
        self.version: int | None = None  # of the last push it took part in
        # said on the group it committed, its ack not here yet: pushes wait for it (as for
        # one that just joined, JOIN_GRACE seconds at most)
        self.returning = False
        self.late = False  # missed the push's timeout
        self.told = 0  # the last push whose message to it is on its way
        self.handles: list[bytes] = []
        self.targets: dict[str, Any] | None = None  # see Ack.targets
        self.checksums: list[int] = []

    @property
    def idle(self) -> bool:
        return self.parked is not None and not self.parked.done() and not self.gone

    @property
    def settled(self) -> bool:
        return self.gone or self.error is not None or self.step in (DONE, ABORTED)


@dataclass
class Push:
    seq: int
    version: int
    plan: dict[str, Any] | None  # the plan to send to members that need it
    fingerprint: str
    members: list[Member]
    setups: dict[bytes, dict[str, Any]]  # key -> transport descriptor, for members that need setup
    collective: bool
    verify: bool
    direct: bool = False  # its members were started on their lines, not through the hub
    delta: dict[str, Any] | None = None  # a delta push's header, for every member's Setup
    unstarted: dict[str, str] = field(default_factory=dict)  # members whose start did not go
    # a mailbox push's members told of its every bucket on their lines (by the pushing
    # thread: see Finisher): the hub does not answer their parked requests with buckets
    lined: set[bytes] = field(default_factory=set)
    ready: int = 0  # buckets announced
    streaming: bool = False
    aborted: str | None = None
    checksums: list[int | None] = field(default_factory=list)
    # set on the loop when every member has settled: the pushing thread waits on it
    # itself, without a hop to the loop and back
    settled: threading.Event = field(default_factory=threading.Event)
    # set on the loop once every member's message of this push is on its way (a pushing
    # thread holding the GIL would keep the loop from sending it: it waits on this first)
    told: threading.Event = field(default_factory=threading.Event)
