"""The engine side of a sharded update: one engine rank takes its slices from every
trainer rank that owns them (see ``_sharded`` for the whole picture)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlferry.errors import RequestError

from .._errors import BlockFP8Error, ReceiverClosed, WeightSyncError
from .._report import ShardedReceiverStatistics
from ..planning._blocks import BLOCK_FP8
from ..planning._layouts import EngineLayout, TrainerLayout
from ..planning._shard_plan import ShardPlan
from ..planning._specs import TensorSpec
from ..receiver._receiver import link_receiver
from ._links import Link, Op, ops_of, targets_for
from ._plans import Plans, check_rank, link_group

__all__ = ["ShardedReceiver"]


class ShardedReceiver:
    """One engine rank's receiver: takes its slices from every trainer rank that owns them.

    ``params``: the engine's tensors by name (this rank's :meth:`EngineLayout.param_specs`:
    shapes and dtypes are checked); each piece is copied into its box of them in
    place. ``addresses``: each trainer rank's :attr:`ShardedSender.address` (a list by
    rank, or a mapping). ``version`` is the last version every needed sender's part of
    arrived and loaded; ``on_commit(version)`` is called then.

    A trainer rank that dies or fails makes :meth:`wait_for` raise
    ``WeightSyncError`` naming that rank and its reason (``failures``: ``{"trainer
    rank 1": reason}``); the receiver keeps its last whole version (the tensors of a
    part that loaded before the failure hold the new bytes until the next update: load
    in place, as a WeightReceiver does). :meth:`connect` joins a rank's replacement.

    ``point_to_point``: the senders run a link per engine rank (``ShardedSender(...,
    point_to_point=True)``); an entry of ``addresses`` may then map engine ranks to
    addresses (the sender's ``addresses``).

    ``around_load(load, items)``: called for every bucket in place of ``load(items)``
    (which copies its pieces into ``params``), on that sender's receiver thread: an
    engine that must stop stepping before its parameters change, check the values or
    count what loaded, as it does for a WeightReceiver's ``load``; it calls ``load``.
    """

    def __init__(
        self,
        *,
        group: str,
        rank: int,
        trainer: TrainerLayout,
        engine: EngineLayout,
        params: Mapping[str, torch.Tensor],
        addresses: Sequence[str | Mapping[int, str]] | Mapping[int, str | Mapping[int, str]],
        on_commit: Callable[[int], Any] | None = None,
        name: str | None = None,
        device: Any = None,
        secret: str | bytes | None = None,
        verify: bool = False,
        point_to_point: bool = False,
        around_load: Callable[[Callable[[list[tuple[str, torch.Tensor]]], None],
                               list[tuple[str, torch.Tensor]]], Any] | None = None,
    ) -> None:  # fmt: skip
        self.rank = check_rank("ShardedReceiver", rank, len(engine.receivers), "engine")
        self.group = group
        self.name = name or f"engine-rank-{rank}"
        self._plans = Plans(trainer, engine)
        self._params = dict(params)
        self._addresses = (
            dict(enumerate(addresses)) if isinstance(addresses, Sequence) else dict(addresses)
        )
        self._on_commit = on_commit
        self._around_load = around_load
        self.point_to_point = point_to_point
        self._link_args = {"device": device, "secret": secret, "verify": verify}
        self._cond = threading.Condition()
        self._links: dict[int, Link] = {}
        self._version: int | None = None
        self._advanced = False  # the version moved, its waiters not woken yet
        self._closed = False
        self._ops: dict[int, dict[str, list[Op]]] = {}
        self._build_ops(self._plans.get())

    # -- the plan and the copies ------------------------------------------------------
    def _build_ops(self, plan: ShardPlan) -> None:
        self._ops = ops_of(plan, self.rank, self._params, self.point_to_point)
        for link in list(getattr(self, "_links", {}).values()):
            link.copies.clear()  # new destinations

    def plan(self) -> ShardPlan:
        return self._plans.get()

    def set_layouts(
        self,
        *,
        trainer: TrainerLayout | None = None,
        engine: EngineLayout | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
        addresses: Mapping[int, str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        """New layouts (and this rank's new tensors), between updates: the plan is computed
        anew, ranks it no longer needs are left and ranks it newly needs joined."""
        self._plans.set(trainer, engine)
        if params is not None:
            self._params = dict(params)
        self._addresses.update(addresses or {})
        plan = self._plans.get()
        self._build_ops(plan)
        need = set(plan.senders_of(self.rank))
        # new tensors: a sender that writes into the old ones joins again (its next push
        # brings the plan, and it gets the new ones)
        renew = params is not None and self._around_load is None
        for s in [s for s in self._links if s not in need or renew]:
            self._drop(s)
        for s in sorted(need - set(self._links)):
            self.connect(s, self._address(s), timeout)

    def _address(self, s: int) -> str:
        a = self._addresses.get(s)
        if isinstance(a, Mapping):  # a sender's addresses by engine rank (point to point)
            a = a.get(self.rank)
        if a is None:
            raise RequestError(
                f"ShardedReceiver.addresses: expected the address of trainer rank {s} (this "
                f"rank needs its bytes), got none (give every ShardedSender.address)"
            )
        return a

    # -- life ---------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> ShardedReceiver:
        """Join every trainer rank this engine rank needs bytes from (if one cannot be
        joined, the ones joined are left again and its error raised)."""
        try:
            for s in self._plans.get().senders_of(self.rank):
                self.connect(s, self._address(s), timeout)
        except BaseException:
            for s in list(self._links):
                self._drop(s)
            raise
        return self

    def connect(self, sender: int, address: str | Mapping[int, str], timeout: float = 30.0) -> None:
        """Join trainer rank ``sender`` at ``address`` (its replacement, after it died: its
        ``address``, or point to point its ``addresses``); a later push of it brings the
        plan."""
        if self._closed:
            raise ReceiverClosed(f"receiver `{self.name}` is closed (make a new ShardedReceiver)")
        if isinstance(address, Mapping):  # checked before the rank's link is dropped
            if self.rank not in address:
                raise RequestError(
                    f"connect.address: expected trainer rank {sender}'s addresses by engine "
                    f"rank, with this one's ({self.rank}), got engine ranks {sorted(address)} "
                    "(give the replacement's ShardedSender.addresses)"
                )
            address = address[self.rank]
        self._drop(sender)
        self._addresses[sender] = address
        link = Link(sender, address)
        load = functools.partial(self._load, link)
        around = self._around_load
        r = link_receiver(
            group=link_group(self.group, sender, self.rank if self.point_to_point else None),
            address=address,
            load=load if around is None else functools.partial(around, load),
            on_commit=lambda v: self._link_commit(link, v),
            on_failure=lambda why, final: self._link_failure(link, why, final),
            expected=lambda specs: self._check_link(link, specs),
            name=f"{self.name}<-trainer{sender}",
            # no hook to run before our tensors change: a sender may write them
            targets=functools.partial(self._targets_for, link) if around is None else None,
            after_ack=self._link_acked,
            **self._link_args,
        )
        link.receiver = r
        with self._cond:
            link.version = self._version  # what it holds of this rank's bytes: the whole version
            self._links[sender] = link
        try:
            r.start(timeout)
        except BaseException:
            with self._cond:
                if self._links.get(sender) is link:
                    del self._links[sender]
            r.close()
            raise

    def _drop(self, sender: int) -> None:
        with self._cond:
            link = self._links.pop(sender, None)
        if link is not None and link.receiver is not None:
            link.receiver.close()

    def close(self) -> None:
        """Leave every trainer rank; ``wait_for`` a version not held raises ReceiverClosed."""
        self._closed = True
        for s in list(self._links):
            self._drop(s)
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> ShardedReceiver:
        return self.start() if not self._links else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- per link, on its receiver's thread ---------------------------------------------
    def _check_link(self, link: Link, specs: list[TensorSpec]) -> None:
        plan = self._plans.get()
        if self.point_to_point:
            want = [p.spec() for p in plan.link(link.sender, self.rank)[0]]
        else:
            want = plan.stream_specs(link.sender)
        if specs == want:
            return
        diff = next(
            (f"piece {i}: expected `{w.name}` {w.describe()}, got `{g.name}` {g.describe()}"
             for i, (w, g) in enumerate(zip(want, specs, strict=False)) if w != g),
            f"expected {len(want)} pieces, got {len(specs)}",
        )  # fmt: skip
        mine = {w.name for w in want}
        block = next((g.name for g in specs if g.name.endswith(f":{BLOCK_FP8}")
                      and g.name not in mine), None)  # fmt: skip
        if block is not None:
            raise BlockFP8Error(
                f"trainer rank {link.sender} sends `{block}` in block FP8, which this "
                f"receiver's plan {plan.fingerprint} does not keep so ({diff}); no byte "
                "moved and this rank keeps its version (give every sender and receiver the "
                "same engine layout)"
            )
        raise RequestError(
            f"trainer rank {link.sender} sends pieces this receiver's plan {plan.fingerprint} "
            f"does not: {diff} (give every sender and receiver the same layouts)"
        )

    def _load(self, link: Link, items: list[tuple[str, torch.Tensor]]) -> None:
        with self._cond:
            if link.failure is not None and not link.failure[2]:
                link.failure = None  # a new push of this rank reached us
        link.load(self._ops.get(link.sender, {}), items)

    def _targets_for(
        self, link: Link, plan: Any
    ) -> list[list[tuple[tuple[slice, ...], torch.Tensor]]] | None:
        """Where each tensor of a link's plan goes in this rank's tensors (see
        :func:`targets_for`)."""
        return targets_for(self._ops.get(link.sender, {}), plan)

    def _link_commit(self, link: Link, version: int) -> None:
        with self._cond:
            if self._links.get(link.sender) is not link:
                raise WeightSyncError(f"trainer rank {link.sender}: this link was replaced")
            before = link.version
            link.version, link.failure = version, None
            whole = self._whole()
            if whole is not None and (self._version is None or whole > self._version):
                if self._on_commit is not None:
                    try:
                        self._on_commit(whole)
                    except BaseException:
                        link.version = before
                        raise
                self._version = whole
                self._advanced = True  # its waiters are woken once this link's ack went

    def _link_acked(self) -> None:
        """A link's commit was acknowledged: wake the waiters if the whole version moved (a
        link's commit that did not move it wakes nobody: they would take the GIL from the
        links still loading)."""
        with self._cond:
            if self._advanced:
                self._advanced = False
                self._cond.notify_all()

    def _whole(self) -> int | None:
        versions = [lk.version for lk in self._links.values()]
        if not versions or any(v is None for v in versions):
            return None
        return min(v for v in versions if v is not None)

    def _link_failure(self, link: Link, why: str, final: bool) -> None:
        with self._cond:
            if self._links.get(link.sender) is not link:
                return  # a replaced link's end
            pushing = link.receiver.pushing if link.receiver is not None else None
            link.failure = (pushing, why, final)
            self._cond.notify_all()

    # -- versions ---------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The last version whose every part arrived and loaded, or None before the first."""
        return self._version

    def _blocked(self, version: int) -> tuple[int, str, bool] | None:
        for s, lk in sorted(self._links.items()):
            if lk.failure is None or (lk.version is not None and lk.version >= version):
                continue
            at, why, final = lk.failure
            if final or at is None or at >= version:
                return s, why, final
        return None

    def wait_for(self, version: int, timeout: float | None = None) -> bool:
        """Block until ``self.version >= version``; False if ``timeout`` ran out first.

        Raises (at once, not at the timeout):
            WeightSyncError: a trainer rank's part of ``version`` failed or its sender
                went away (the message and ``failures`` name the rank and why).
            ReceiverClosed: the receiver was closed.
        """

        def reached() -> bool:
            return self._version is not None and self._version >= version

        with self._cond:
            self._cond.wait_for(
                lambda: reached() or self._closed or self._blocked(version) is not None, timeout
            )
            if reached():
                return True
            blocked = self._blocked(version)
            if blocked is not None:
                s, why, final = blocked
                where = self._addresses.get(s)
                if isinstance(where, Mapping):
                    where = where.get(self.rank)
                at = "" if str(where) in why else f" ({where})"  # once in the message
                fix = " (join a dead rank's replacement by connect)" if final else ""
                raise WeightSyncError(
                    f"receiver `{self.name}` (engine rank {self.rank}) cannot reach version "
                    f"{version}: trainer rank {s}{at}: {why}; it stays at "
                    f"version {self._version}{fix}",
                    {f"trainer rank {s}": why},
                )
            if self._closed:
                raise ReceiverClosed(
                    f"receiver `{self.name}` cannot reach version {version}: it is closed "
                    f"(at version {self._version})"
                )
            return False

    def statistics(self) -> ShardedReceiverStatistics:
        plan = self._plans.get()
        with self._cond:
            links = dict(self._links)
        return ShardedReceiverStatistics(
            rank=self.rank,
            name=self.name,
            version=self._version,
            plan=plan.fingerprint,
            plans_computed=self._plans.computed,
            needed_bytes=sum(plan.link_bytes(s, self.rank) for s in plan.senders_of(self.rank)),
            links={s: lk.receiver.statistics() for s, lk in links.items() if lk.receiver},
            failures={s: lk.failure[1] for s, lk in links.items() if lk.failure is not None},
        )
