"""Many senders to many receivers: every trainer rank sends what it owns, once.

Each trainer rank runs a :class:`ShardedSender`: one :class:`WeightSender` (the
per-link primitive, any transport) whose pushed tensors are the rank's pieces of
the plan (views of its local shards, narrowed, cast when the engine's dtype is
narrower). Each engine rank runs a :class:`ShardedReceiver`: one
:class:`WeightReceiver` per trainer rank it needs bytes from, whose ``load``
copies each of *its* pieces into the engine's parameters and skips the others
(receivers that share a sender's bucket stream read only their own bytes). A
version is committed when every sender's part of it arrived and loaded.

Both sides compute the same :class:`ShardPlan` from the same two layouts (it is
a pure function of them); every link's plan is checked against it before a
byte moves, so layouts that disagree fail by name, never load wrong bytes. One
trainer rank that owns everything and one receiver that needs everything whole
is today's single sender: exactly one WeightSender and one WeightReceiver.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ._boxes import extents, relative, slices
from ._errors import ReceiverClosed, WeightSyncError
from ._layouts import EngineLayout, TrainerLayout
from ._plan import TensorSpec
from ._receiver import WeightReceiver
from ._report import (
    PushReport,
    ShardedReceiverStatistics,
    ShardedSenderStatistics,
)
from ._sender import WeightSender
from ._shardplan import ShardPlan

__all__ = ["ShardedReceiver", "ShardedSender", "link_group"]


def link_group(group: str, rank: int) -> str:
    """The group name of trainer rank ``rank``'s link: receivers join it by this name."""
    return f"{group}/trainer{rank}"


class _Plans:
    """The plan for the current layouts, computed only when a fingerprint changes."""

    def __init__(self, trainer: TrainerLayout, engine: EngineLayout) -> None:
        self.trainer, self.engine = trainer, engine
        self.computed = 0
        self._plan: ShardPlan | None = None
        self._lock = threading.Lock()  # links' threads ask for it too

    def set(self, trainer: TrainerLayout | None, engine: EngineLayout | None) -> None:
        with self._lock:
            self.trainer = trainer or self.trainer
            self.engine = engine or self.engine

    def get(self) -> ShardPlan:
        with self._lock:
            p = self._plan
            if (
                p is None
                or p.trainer.fingerprint != self.trainer.fingerprint
                or p.engine.fingerprint != self.engine.fingerprint
            ):
                p = self._plan = ShardPlan.build(self.trainer, self.engine)
                self.computed += 1
            return p


def _check_rank(owner: str, rank: Any, n: int, what: str) -> int:
    if type(rank) is not int or not 0 <= rank < n:
        raise ValueError(
            f"{owner}.rank: expected an int in [0, {n}) (the {what} layout has {n}), got {rank!r}"
        )
    return rank


class ShardedSender:
    """One trainer rank's sender: pushes the bytes of its shards that engines need.

    ``trainer`` and ``engine``: the layouts (see :func:`fsdp_layout`,
    :func:`dtensor_layout`, :func:`tp_layout`); every rank and every receiver must be
    given the same ones. ``receivers``: how many receivers the first push waits for
    (default: every receiver that needs bytes of this rank). The other arguments are
    :class:`WeightSender`'s; its group is :func:`link_group` ``(group, rank)``.
    """

    def __init__(
        self,
        *,
        group: str,
        rank: int,
        trainer: TrainerLayout,
        engine: EngineLayout,
        transport: str = "shm",
        receivers: int | None = None,
        bucket_bytes: int | None = None,
        bind: str | None = None,
        device: Any = None,
        secret: str | bytes | None = None,
        zero_copy: bool = True,
    ) -> None:
        self.rank = _check_rank("ShardedSender", rank, trainer.ranks, "trainer")
        self.group = group
        self._plans = _Plans(trainer, engine)
        wanted = len(self._plans.get().receivers_of(rank))
        self._sender = WeightSender(
            group=link_group(group, rank),
            transport=transport,
            receivers=receivers if receivers is not None else max(1, wanted),
            bucket_bytes=bucket_bytes,
            bind=bind,
            device=device,
            secret=secret,
            zero_copy=zero_copy,
        )
        self.address: str = self._sender.address

    def plan(self) -> ShardPlan:
        """The plan of the current layouts (computed on first use and on a change)."""
        return self._plans.get()

    def set_layouts(
        self, *, trainer: TrainerLayout | None = None, engine: EngineLayout | None = None
    ) -> None:
        """New layouts (resharded trainer, other engines): the next push plans anew."""
        if trainer is not None:
            _check_rank("ShardedSender", self.rank, trainer.ranks, "trainer")
        self._plans.set(trainer, engine)

    def push(
        self,
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        version: int,
        timeout: float = 60.0,
    ) -> PushReport:
        """Send this rank's pieces of ``named_tensors`` (a ``state_dict()``: DTensors, or
        this rank's local shards as the layout describes them); returns when the
        receivers of this rank committed its part (see :meth:`WeightSender.push`: its
        errors, and ``report.bytes`` is what this rank sent). A rank whose bytes no
        receiver needs sends nothing and returns at once.

        Raises (besides WeightSender.push's):
            WeightSyncError: a tensor the plan needs is missing, or its local shard's
                shape is not the one the layout gives this rank.
        """
        plan = self._plans.get()
        pieces = self._pieces(plan, named_tensors)
        if not pieces:
            return PushReport(version, 0, 0.0, (), 0, 0, False)
        return self._sender.push(pieces, version=version, timeout=timeout)

    @torch.no_grad()
    def _pieces(
        self, plan: ShardPlan, named: Mapping[str, Any] | Iterable[tuple[str, Any]]
    ) -> list[tuple[str, torch.Tensor]]:
        items = named.items() if isinstance(named, Mapping) else named
        local: dict[str, torch.Tensor] = {}
        for n, t in items:
            local[n] = t.to_local() if hasattr(t, "to_local") else t
        owned = plan.trainer.owned[self.rank]
        out = []
        for p in plan.streams[self.rank]:
            t = local.get(p.source)
            box = owned[p.source]
            if t is None:
                raise WeightSyncError(
                    f"push: tensor `{p.source}`: expected it (trainer rank {self.rank} owns "
                    f"{list(extents(box))} of it and receivers need them), got no such name"
                )
            if tuple(t.shape) != extents(box):
                raise WeightSyncError(
                    f"push: tensor `{p.source}` on trainer rank {self.rank}: expected its local "
                    f"shard of shape {list(extents(box))}, got {list(t.shape)} (the trainer "
                    "layout does not describe this rank's tensors)"
                )
            v = t[slices(relative(p.box, box))] if p.box != box else t.detach()
            out.append((p.name, v.to(p.dtype) if v.dtype != p.dtype else v))
        return out

    def statistics(self) -> ShardedSenderStatistics:
        plan = self._plans.get()
        return ShardedSenderStatistics(
            rank=self.rank,
            plan=plan.fingerprint,
            plans_computed=self._plans.computed,
            pieces=len(plan.streams[self.rank]),
            stream_bytes=plan.stream_bytes(self.rank),
            receivers=tuple(plan.receivers_of(self.rank)),
            link=self._sender.statistics(),
        )

    def close(self) -> None:
        """Stop serving: receivers see this rank gone and keep their last whole version."""
        self._sender.close()

    def __enter__(self) -> ShardedSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Link:
    """One trainer rank, as an engine rank sees it: its receiver and where it stands."""

    def __init__(self, sender: int, address: str) -> None:
        self.sender = sender
        self.address = address
        self.receiver: WeightReceiver | None = None
        self.version: int | None = None
        self.failure: tuple[int | None, str, bool] | None = None  # (version, reason, final)


_Op = tuple[tuple[slice, ...], torch.Tensor, bool]  # piece region, destination view, reshape


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
    """

    def __init__(
        self,
        *,
        group: str,
        rank: int,
        trainer: TrainerLayout,
        engine: EngineLayout,
        params: Mapping[str, torch.Tensor],
        addresses: Sequence[str] | Mapping[int, str],
        on_commit: Callable[[int], Any] | None = None,
        name: str | None = None,
        device: Any = None,
        secret: str | bytes | None = None,
        verify: bool = False,
    ) -> None:
        self.rank = _check_rank("ShardedReceiver", rank, len(engine.receivers), "engine")
        self.group = group
        self.name = name or f"engine-rank-{rank}"
        self._plans = _Plans(trainer, engine)
        self._params = dict(params)
        self._addresses = (
            dict(enumerate(addresses)) if isinstance(addresses, Sequence) else dict(addresses)
        )
        self._on_commit = on_commit
        self._link_args = {"device": device, "secret": secret, "verify": verify}
        self._cond = threading.Condition()
        self._links: dict[int, _Link] = {}
        self._version: int | None = None
        self._closed = False
        self._ops: dict[int, dict[str, list[_Op]]] = {}
        self._build_ops(self._plans.get())

    # -- the plan and the copies ------------------------------------------------------
    def _build_ops(self, plan: ShardPlan) -> None:
        want = plan.engine.param_specs(self.rank)
        for n, spec in want.items():
            t = self._params.get(n)
            if t is None or tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                got = "no such tensor" if t is None else f"shape {list(t.shape)} {t.dtype}"
                raise ValueError(
                    f"ShardedReceiver.params[{n!r}]: expected {spec.describe()} (engine rank "
                    f"{self.rank} of the engine layout), got {got} (give this rank's tensors, "
                    "made from EngineLayout.param_specs)"
                )
        ops: dict[int, dict[str, list[_Op]]] = {}
        for s in plan.senders_of(self.rank):
            mine: dict[str, list[_Op]] = {}
            for c in plan.copies[(s, self.rank)]:
                dst = self._params[c.param][slices(c.at)]
                mine.setdefault(c.piece, []).append(
                    (slices(c.within), dst, extents(c.within) != tuple(dst.shape))
                )
            ops[s] = mine
        self._ops = ops

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
        for s in [s for s in self._links if s not in need]:
            self._drop(s)
        for s in sorted(need - set(self._links)):
            self.connect(s, self._address(s), timeout)

    def _address(self, s: int) -> str:
        a = self._addresses.get(s)
        if a is None:
            raise ValueError(
                f"ShardedReceiver.addresses: expected the address of trainer rank {s} (this "
                f"rank needs its bytes), got none (give every ShardedSender.address)"
            )
        return a

    # -- life ---------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> ShardedReceiver:
        """Join every trainer rank this engine rank needs bytes from."""
        for s in self._plans.get().senders_of(self.rank):
            self.connect(s, self._address(s), timeout)
        return self

    def connect(self, sender: int, address: str, timeout: float = 30.0) -> None:
        """Join trainer rank ``sender`` at ``address`` (its replacement, after it died);
        a later push of it brings the plan."""
        if self._closed:
            raise ReceiverClosed(f"receiver `{self.name}` is closed (make a new ShardedReceiver)")
        self._drop(sender)
        self._addresses[sender] = address
        link = _Link(sender, address)
        r = WeightReceiver(
            group=link_group(self.group, sender),
            address=address,
            load=lambda items: self._load(link, items),
            on_commit=lambda v: self._link_commit(link, v),
            on_failure=lambda why, final: self._link_failure(link, why, final),
            expected=lambda specs: self._check_link(link, specs),
            name=f"{self.name}<-trainer{sender}",
            **self._link_args,
        )
        link.receiver = r
        with self._cond:
            link.version = self._version  # what it holds of this rank's bytes: the whole version
            self._links[sender] = link
        r.start(timeout)

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
    def _check_link(self, link: _Link, specs: list[TensorSpec]) -> None:
        plan = self._plans.get()
        want = plan.stream_specs(link.sender)
        if specs == want:
            return
        diff = next(
            (f"piece {i}: expected `{w.name}` {w.describe()}, got `{g.name}` {g.describe()}"
             for i, (w, g) in enumerate(zip(want, specs, strict=False)) if w != g),
            f"expected {len(want)} pieces, got {len(specs)}",
        )  # fmt: skip
        raise ValueError(
            f"trainer rank {link.sender} sends pieces this receiver's plan {plan.fingerprint} "
            f"does not: {diff} (give every sender and receiver the same layouts)"
        )

    def _load(self, link: _Link, items: list[tuple[str, torch.Tensor]]) -> None:
        ops = self._ops.get(link.sender, {})
        with self._cond:
            if link.failure is not None and not link.failure[2]:
                link.failure = None  # a new push of this rank reached us
        for name, t in items:
            for region, dst, reshape in ops.get(name, ()):  # pieces for others: skipped
                src = t[region]
                dst.copy_(src.reshape(dst.shape) if reshape else src)

    def _link_commit(self, link: _Link, version: int) -> None:
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
            self._cond.notify_all()

    def _whole(self) -> int | None:
        versions = [lk.version for lk in self._links.values()]
        if not versions or any(v is None for v in versions):
            return None
        return min(v for v in versions if v is not None)

    def _link_failure(self, link: _Link, why: str, final: bool) -> None:
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
                fix = " (join a dead rank's replacement by connect)" if final else ""
                raise WeightSyncError(
                    f"receiver `{self.name}` (engine rank {self.rank}) cannot reach version "
                    f"{version}: trainer rank {s} ({self._addresses.get(s)}): {why}; it stays at "
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
