"""The control messages between a sender and its receivers: tagged, frozen structs.

Receivers are clients of the sender's wire service and long-poll it: each
request reports what the receiver finished (``Ack``) and is answered with the
next thing to do, parked at the sender until there is one. Tensor data never
travels in these messages: it lies in the transport's buffers.

    receiver                              sender
    Join  ─────────────────────────────▶  Welcome (or an error: wrong group, transport)
    Ack(idle) ─────────────────────────▶  ... parked until a push ...
              ◀─────────────────────────  Setup (plan, buffers or group)   first time only
    Ack(plan) ─────────────────────────▶  Bucket 0        (shm, cuda_ipc: one per bucket)
    Ack(want=1) ───────────────────────▶  Bucket 1 ...    or Stream (broadcast: all at once)
    Ack(0, park=False) ────────────────▶  Noted
    Ack(done) ─────────────────────────▶  ... parked until the next push ...

Over a collective, a push after one that committed may instead send ``Stream`` on
the receiver's start line (see _line): its parked request stays parked, and its
acknowledgements of that push go unparked (``park=False``).

A receiver of an NCCL group waits for its stream on the device, deaf to its own
socket; a second connection of its process keeps a ``Watch`` parked (the key
``Welcome`` gave it), answered with ``Abort`` when a push it streams is aborted
(another receiver died, the sender failed) or ``Noted`` when it left: it then
aborts its side of the group, and the wait on the device ends at once.

A receiver that knows one address of a group of many senders (a trainer whose
ranks each send their own shards) asks it to describe the group first
(``Describe``, answered with ``Described``: every rank's address and the trainer
layout, or no senders at all from a sender that is not part of such a group).

For a broadcast group whose sender has a secret, the receivers' rendezvous store
operations travel here too (``StoreOp``, answered with ``StoreReply``): the
group meets over the authenticated channel, not over an open store socket.

A receiver asks for bucket k+1 (``want``) before it loads bucket k, and reports
bucket k loaded in a bare acknowledgement: the next bucket's announcement is
already there when a load ends, and no round trip stands between two loads.
When several buckets are ready at once (cuda_ipc zero copy announces them all),
one ``Bucket`` names them all (``last``) and the receiver loads them in a row.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "ABORTED",
    "DONE",
    "IDLE",
    "PLAN",
    "Abort",
    "Ack",
    "Bucket",
    "Committed",
    "Describe",
    "Described",
    "Join",
    "Leave",
    "Noted",
    "Setup",
    "StoreOp",
    "StoreReply",
    "Stream",
    "Watch",
    "Welcome",
    "decode_reply",
    "decode_request",
    "encode",
]

# Ack.step: what the receiver finished in push ``seq``; 0, 1, ... are buckets.
IDLE = -4  # nothing (just joined, or between pushes)
ABORTED = -3  # dropped an aborted push
PLAN = -1  # validated the plan and attached the buffers or group
DONE = 1 << 40  # loaded every bucket and committed


class Join(msgspec.Struct, frozen=True, tag="join"):
    group: str
    transport: str
    name: str
    host: str
    pid: int
    verify: bool = False  # wants a checksum of every bucket
    line: str = ""  # where its streams may be started from the pushing thread (see _line)
    deltas: str = ""  # how it takes delta pushes ("in_place", "base"; "": it takes none)


class Leave(msgspec.Struct, frozen=True, tag="leave"):
    pass


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    seq: int
    step: int
    error: str | None = None
    handles: list[bytes] = []  # cuda_ipc: the receiver's interprocess events, with Ack(PLAN)
    # cuda_ipc zero copy, with Ack(PLAN): the receiver's tensors the sender writes into
    targets: dict[str, Any] | None = None
    checksums: list[int] = []
    want: int | None = None  # the bucket to answer with (default: the one after ``step``)
    park: bool = True  # False: a bare acknowledgement, answered at once with Noted
    holds: int = -1  # the version it holds whole (-1: none: it never committed, or loaded
    # part of a push since)


class StoreOp(msgspec.Struct, frozen=True, tag="store"):
    """One operation on the broadcast group's rendezvous store (see transports/_rendezvous)."""

    op: str  # set, get, wait, check, add, compare_set, delete, num_keys
    key: str = ""
    keys: list[str] = []
    value: bytes = b""
    expected: bytes = b""
    amount: int = 0
    timeout: float = 0.0  # get, wait: how long to wait for the keys


class Describe(msgspec.Struct, frozen=True, tag="describe"):
    """Who sends the weights of ``group``? (No join needed; nothing changes at the sender.)"""

    group: str


class Described(msgspec.Struct, frozen=True, tag="described"):
    """The senders of ``group``: each trainer rank's address, by rank, and the trainer
    layout (each tensor's name, shape and dtype; per rank, the box of each tensor it
    owns). No senders: one sender that pushes whatever it is given (a WeightSender).
    Point to point (``engine_rank`` >= 0): the address asked is rank 0's link to engine
    rank ``engine_rank`` of ``engines`` (each a replica needing every tensor whole), and
    ``senders`` are every rank's link to that engine rank ("": none)."""

    group: str
    senders: list[str] = []
    specs: list[tuple[str, list[int], str]] = []
    owned: list[dict[str, list[tuple[int, int]]]] = []
    engine_rank: int = -1
    engines: int = 0


class StoreReply(msgspec.Struct, frozen=True, tag="stored"):
    value: bytes = b""
    number: int = 0


class Welcome(msgspec.Struct, frozen=True, tag="welcome"):
    group: str
    transport: str
    key: bytes = b""  # the receiver's key at the sender (what a Watch names)
    pid: int = 0  # the sender's process: the only one whose starts its line takes
    line: bool = False  # the sender reached the receiver's line (its streams start there)
    commits: str = ""  # the sender's commit line, where a commit is told first (see _line)


class Watch(msgspec.Struct, frozen=True, tag="watch"):
    """Answer when a push after ``seen`` that receiver ``key`` takes part in is aborted
    (``Abort``), or when it left (``Noted``); sent on a connection of its own (see the
    module's note)."""

    key: bytes
    seen: int = 0  # the last push whose abort the watcher was told of


class Setup(msgspec.Struct, frozen=True, tag="setup"):
    seq: int
    plan: dict[str, Any]
    transport: dict[str, Any]  # the buffers to map, or the group to join
    version: int = -1  # of the push it belongs to (-1: a sender that does not say)
    delta: dict[str, Any] | None = None  # a delta push's header (see delta._header)


class Bucket(msgspec.Struct, frozen=True, tag="bucket"):
    seq: int
    version: int
    index: int
    checksum: int | None = None
    last: int = -1  # buckets index..last are all ready (-1: index only); never with checksums


class Stream(msgspec.Struct, frozen=True, tag="stream"):
    seq: int
    version: int
    verify: bool = False  # a last collective carries every bucket's checksum


class Noted(msgspec.Struct, frozen=True, tag="noted"):
    pass


class Committed(msgspec.Struct, frozen=True, tag="committed"):
    """A receiver's word on its sender's commit line (see _line) that it committed push
    ``seq``; ``key``: its key at the sender (``Welcome.key``)."""

    seq: int
    key: bytes


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    seq: int
    reason: str
    version: int = -1  # of the push it aborts (-1: a sender that does not say)


Request = Join | Ack | Leave | StoreOp | Describe | Watch
Reply = Welcome | Setup | Bucket | Stream | Abort | Noted | StoreReply | Described

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: Any) -> Join | Ack | Leave | StoreOp | Describe | Watch:
    return _requests.decode(data)


def decode_reply(
    data: Any,
) -> Welcome | Setup | Bucket | Stream | Abort | Noted | StoreReply | Described:
    return _replies.decode(data)
