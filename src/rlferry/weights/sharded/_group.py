"""A group of senders found from one address: what an engine needs to join every rank.

An engine is told one address (``init_weight_transfer(group, address)``: the
protocol every adapter speaks). When the trainer's ranks each send their own shards
(a :class:`ShardedSender` per rank), rank 0's sender also answers ``Describe``: every
rank's address and the trainer layout, msgspec on the wire like every control
message. A :class:`WeightSender` on its own describes itself with no senders (one
sender that pushes whatever it is given), so a receiver knows which kind to run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlferry.errors import RequestError
from rlferry.wire import (
    AsyncClient,
    PeerGone,
    RemoteError,
    RequestTimeout,
    SecurityError,
    WireError,
    wire_loop,
)

from .._errors import SenderGone, WeightSyncError
from ..planning._layouts import TrainerLayout
from ..planning._specs import TensorSpec, dtype_from_name, dtype_name
from ..protocol._messages import Describe, Described, decode_reply, encode

__all__ = ["SenderGroup", "describe_group", "described"]


@dataclass(frozen=True)
class SenderGroup:
    """The senders of ``group``: ``addresses[r]`` is trainer rank ``r``'s, ``trainer``
    the layout they send from. Both None: one :class:`WeightSender` on its own. Point to
    point: ``engine_rank`` is the asker's, of ``engines`` engine ranks each needing every
    tensor whole, and ``addresses[r]`` rank ``r``'s link to it ("": none)."""

    group: str
    addresses: tuple[str, ...] | None
    trainer: TrainerLayout | None
    engine_rank: int | None = None
    engines: int = 0

    @property
    def sharded(self) -> bool:
        return self.trainer is not None


def described(
    group: str, addresses: Sequence[str], trainer: TrainerLayout, engine_rank: int = -1,
    engines: int = 0,
) -> Described:  # fmt: skip
    """The ``Described`` reply for ``group``: its ranks' addresses and their layout (point
    to point: each rank's link to engine rank ``engine_rank`` of ``engines``)."""
    if len(addresses) != trainer.ranks:
        raise RequestError(
            f"addresses: expected one per trainer rank ({trainer.ranks}), got {len(addresses)}"
        )
    return Described(
        group,
        list(addresses),
        [(s.name, list(s.shape), dtype_name(s.dtype)) for s in trainer.specs],
        [{n: list(b) for n, b in owned.items()} for owned in trainer.owned],
        engine_rank,
        engines,
    )


def _group_of(reply: Described, address: str) -> SenderGroup:
    if not reply.senders:
        return SenderGroup(reply.group, None, None)
    try:
        specs = [TensorSpec(n, tuple(shape), dtype_from_name(d)) for n, shape, d in reply.specs]
        owned = tuple({n: tuple(b) for n, b in boxes.items()} for boxes in reply.owned)
        trainer = TrainerLayout(tuple(specs), owned)
    except ValueError as e:  # WeightSyncError is one too
        raise WeightSyncError(
            f"the sender at {address} described group {reply.group!r} with a layout that does "
            f"not hold: {e}"
        ) from None
    if trainer.ranks != len(reply.senders):
        raise WeightSyncError(
            f"the sender at {address} described group {reply.group!r} with "
            f"{len(reply.senders)} addresses for {trainer.ranks} trainer ranks"
        )
    if reply.engine_rank < 0:
        return SenderGroup(reply.group, tuple(reply.senders), trainer)
    if not 0 <= reply.engine_rank < reply.engines:
        raise WeightSyncError(
            f"the sender at {address} described group {reply.group!r} with engine rank "
            f"{reply.engine_rank} of {reply.engines}"
        )
    return SenderGroup(reply.group, tuple(reply.senders), trainer, reply.engine_rank, reply.engines)


def describe_group(
    group: str, address: str, *, secret: str | bytes | None = None, timeout: float = 30.0
) -> SenderGroup:
    """Ask the sender at ``address`` who sends the weights of ``group``.

    Raises:
        SenderGone: no sender at the address, or none answered within ``timeout``.
        WeightSyncError: the sender refused (not its group) or described a group that
            does not hold together.
    """
    loop = wire_loop()

    async def ask() -> Any:
        client = AsyncClient(address, secret=secret)
        try:
            return await client.request(encode(Describe(group)), timeout)
        finally:
            await client.aclose()

    try:
        reply = decode_reply(loop.run(ask()))
    except RemoteError as e:
        raise WeightSyncError(f"group {group!r} at {address}: {e.message}") from None
    except PeerGone as e:
        raise SenderGone(f"cannot reach the sender of group {group!r} at {address}: {e}") from None
    except (RequestTimeout, asyncio.TimeoutError):
        raise SenderGone(
            f"no answer from the sender of group {group!r} at {address} within {timeout:g} s "
            "(is the sender running, and is this its address?)"
        ) from None
    except (WireError, SecurityError) as e:
        raise WeightSyncError(f"no answer from the sender at {address}: {e}") from None
    if not isinstance(reply, Described):
        raise WeightSyncError(
            f"the sender at {address}: expected a description of group {group!r}, got "
            f"{type(reply).__name__}"
        )
    return _group_of(reply, address)
