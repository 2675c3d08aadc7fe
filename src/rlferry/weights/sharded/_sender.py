"""Many senders to many receivers: every trainer rank sends what it owns, once.

Each trainer rank runs a :class:`ShardedSender`: a link (the pushes of one
:class:`WeightSender`, any transport; one per engine rank point to point) whose
pushed tensors are the rank's pieces of the plan (views of its local shards,
narrowed, cast when the engine's dtype is narrower). Each engine rank runs a
:class:`ShardedReceiver`: one :class:`WeightReceiver` per trainer rank it needs
bytes from, whose ``load`` copies each of *its* pieces into the engine's parameters
and skips the others (receivers that share a sender's bucket stream read only their
own bytes). A version is committed when every sender's part of it arrived and loaded.

Both sides compute the same :class:`ShardPlan` from the same two layouts (it is
a pure function of them); every link's plan is checked against it before a
byte moves, so layouts that disagree fail by name, never load wrong bytes. One
trainer rank that owns everything and one receiver that needs everything whole
is the single sender: exactly one link and one WeightReceiver.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rlferry.errors import RequestError

from .._config import SenderConfig
from .._report import PushReport, ShardedSenderStatistics
from ..planning._boxes import full_box
from ..planning._budget import (
    LINK_BUFFER_BYTES,
    MIN_BUCKET_BYTES,
    bucket_cap,
    busier_ends,
    link_ctas,
)
from ..planning._layouts import EngineLayout, TrainerLayout
from ..planning._shard_plan import ShardPlan
from ..planning._specs import moved, where_of
from ..sender._pusher import Pusher
from ..sender._turns import drain, take_turns
from ._cuts import Cuts
from ._group import described
from ._plans import Plans, check_rank, link_group
from ._ready import Ready

__all__ = ["ShardedSender"]


class ShardedSender:
    """One trainer rank's sender: pushes the bytes of its shards that engines need.

    ``trainer`` and ``engine``: the layouts (see :func:`fsdp_layout`,
    :func:`dtensor_layout`, :func:`tp_layout`); every rank and every receiver must be
    given the same ones. ``receivers``: how many receivers the first push waits for
    (default: every receiver that needs bytes of this rank). The other arguments are
    :class:`WeightSender`'s; its group is :func:`link_group` ``(group, rank)``.

    ``point_to_point``: one link per engine rank instead of one shared stream, each
    carrying exactly that rank's bytes (over ``broadcast``, a group of two: NCCL or
    gloo send and receive, the links' pushes running side by side); the receivers
    must say so too. ``addresses`` maps each engine rank to the address it joins.

    ``buffer_bytes``: what the bucket buffers of a rank's links may take together, at
    either end (default 4 GiB): without ``bucket_bytes``, each link's buckets are made
    small enough that the rank with the most links, trainer or engine, stays within it
    (:func:`busier_ends`, :func:`bucket_cap`; give every rank the same). Smaller buckets cost time
    (``rlferry plan-weights`` shows both); an engine rank that hears from 256 trainer
    ranks would otherwise hold two 256 MiB buffers for each.

    Delta pushes are a ``WeightSender``'s: ``delta_budget`` other than 0 is refused.
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
        point_to_point: bool = False,
        buffer_bytes: int = LINK_BUFFER_BYTES,
        delta_budget: int = 0,
    ) -> None:
        if delta_budget != 0:
            raise RequestError(
                f"ShardedSender.delta_budget: delta pushes go through a WeightSender, got "
                f"{delta_budget!r} (a ShardedSender's links push pieces of tensors that its "
                "receivers write into regions of the engine's tensors, which a delta does not "
                "address; push whole tensors with WeightSender(delta_budget=...))"
            )
        self.rank = check_rank("ShardedSender", rank, trainer.ranks, "trainer")
        if type(buffer_bytes) is not int or buffer_bytes < 2 * MIN_BUCKET_BYTES:
            raise RequestError(
                f"ShardedSender.buffer_bytes: expected an int of at least {2 * MIN_BUCKET_BYTES} "
                f"(two buffers of the smallest bucket), got {buffer_bytes!r} (bytes, as an "
                "int: 4 << 30 is 4 GiB)"
            )
        self.buffer_bytes = buffer_bytes
        self.group = group
        self.point_to_point = point_to_point
        self._plans = Plans(trainer, engine)
        self._cuts = Cuts(rank)  # this rank's pieces of each stream, and the last push's
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the links' pushes
        self._moves = transport == "shm" and zero_copy  # a push may move tensors' storages
        self._transport = transport
        wanted = self._plans.get().receivers_of(rank)
        kw = {"transport": transport, "bucket_bytes": bucket_bytes, "bind": bind,
              "device": device, "secret": secret, "zero_copy": zero_copy}  # fmt: skip
        self._links: dict[int, Pusher] = {}
        try:
            if point_to_point:
                for r in wanted:
                    g = link_group(group, rank, r)
                    self._links[r] = Pusher(SenderConfig(group=g, receivers=1, **kw))
            else:
                n = receivers if receivers is not None else max(1, len(wanted))
                self._links[-1] = Pusher(
                    SenderConfig(group=link_group(group, rank), receivers=n, **kw)
                )
        except BaseException:
            self.close()
            raise
        self._cap_links()
        self.addresses: dict[int, str] = (
            {r: w.address for r, w in self._links.items()}
            if point_to_point
            else {r: self._links[-1].address for r in wanted}
        )
        self.address: str = "" if point_to_point else self._links[-1].address
        self._group_addresses: list[Any] | None = None  # described at rank 0's address(es)

    def plan(self) -> ShardPlan:
        """The plan of the current layouts (computed on first use and on a change)."""
        return self._plans.get()

    def set_layouts(
        self, *, trainer: TrainerLayout | None = None, engine: EngineLayout | None = None
    ) -> None:
        """New layouts (resharded trainer, other engines): the next push plans anew.
        Point to point, the engine ranks this rank serves must stay the same."""
        if trainer is not None:
            check_rank("ShardedSender", self.rank, trainer.ranks, "trainer")
            if self._group_addresses is not None and len(self._group_addresses) != trainer.ranks:
                raise RequestError(
                    f"set_layouts.trainer: expected {len(self._group_addresses)} ranks (the "
                    f"group this rank describes), got {trainer.ranks} (describe_group anew)"
                )
        self._plans.set(trainer, engine)
        if self._group_addresses is not None:
            self.describe_group(self._group_addresses)
        self._cap_links()
        if self.point_to_point:
            now = self._plans.get().receivers_of(self.rank)
            if now != sorted(self._links):
                raise RequestError(
                    f"set_layouts: expected the engine ranks {sorted(self._links)} that trainer "
                    f"rank {self.rank} serves point to point, got {now} (make a new "
                    "ShardedSender for other engine ranks)"
                )

    def _cap_links(self) -> None:
        """Each link's largest default bucket, for the current plan (see ``buffer_bytes``),
        and, point to point, its NCCL blocks (:func:`link_ctas`, from its next group on)."""
        ends = busier_ends(self._plans.get(), self.rank, self.point_to_point)
        for r, link in self._links.items():
            if r in ends:
                link.cap_buckets(bucket_cap(self.buffer_bytes, ends[r]))
                if self.point_to_point:
                    link.cap_ctas(link_ctas(ends[r]))

    def describe_group(self, addresses: Sequence[str] | Sequence[Mapping[int, str]]) -> None:
        """Let a receiver that knows only one address of rank 0 find every rank:
        ``addresses[r]`` is rank ``r``'s :attr:`address` (point to point: its
        :attr:`addresses`, by engine rank). An engine told one address (its
        ``init_weight_transfer(group, address)``) asks it for the group's addresses and the
        trainer layout (:func:`describe_group`) and joins every rank it needs. Point to
        point, engine rank ``e`` is told rank 0's ``addresses[e]`` and learns its rank and
        every rank's link to it; each engine rank must then need every tensor whole (a
        replica, as ``EngineLayout.whole`` lays it out). Rank 0 does this once all ranks'
        senders are up; later layouts are described too."""
        given: list[Any] = list(addresses)
        if self.point_to_point:
            self._describe_links(given)
        else:
            if not all(isinstance(a, str) and a for a in given):
                raise RequestError(
                    "describe_group.addresses: expected every rank's address (a str), got "
                    f"{given!r}"
                )
            if len(given) <= self.rank or given[self.rank] != self.address:
                raise RequestError(
                    f"describe_group.addresses: expected this rank's address {self.address!r} "
                    f"at index {self.rank}, got {given!r} (give ShardedSender.address of "
                    "every rank, by rank)"
                )
            self._links[-1].describe_as(described(self.group, given, self._plans.trainer))
        self._group_addresses = given

    def _describe_links(self, addresses: list[Any]) -> None:
        if not all(isinstance(a, Mapping) for a in addresses) or (
            len(addresses) <= self.rank or dict(addresses[self.rank]) != self.addresses
        ):
            raise RequestError(
                f"describe_group.addresses: expected every rank's addresses by engine rank "
                f"(ShardedSender.addresses, point to point), this rank's {self.addresses!r} at "
                f"index {self.rank}, got {addresses!r}"
            )
        engine = self._plans.engine
        split = next(
            (p.name for ps in engine.receivers for p in ps
             if len(p.parts) != 1 or p.parts[0].box != full_box(p.shape)),
            None,
        )  # fmt: skip
        if split is not None:
            raise RequestError(
                f"describe_group: point to point, engine ranks learn only the trainer layout "
                f"and need every tensor whole; parameter `{split}` is a slice (give TP engine "
                "ranks their layout and addresses themselves)"
            )
        n = len(engine.receivers)
        for e, link in self._links.items():
            mine = [str(a.get(e, "")) for a in addresses]
            link.describe_as(described(self.group, mine, self._plans.trainer, e, n))

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
        links = plan.busiest_first(self.rank) if self.point_to_point else [-1]
        if self._transport != "broadcast" and plan is self._cuts.plan:
            for r in links:  # the same tensors as the last pushes' are written first, then
                self._links[r].write_ahead()  # checked (see Launcher.write_ahead)
        try:
            return self._push(plan, links, named_tensors, version, timeout)
        finally:
            for r in links:
                self._links[r].forget_ahead()

    def _push(
        self, plan: ShardPlan, links: list[int], named_tensors: Any, version: int, timeout: float
    ) -> PushReport:
        ready = Ready(self._cuts, plan, named_tensors)
        # the plan, names and shapes of the last push (nothing a push's checks could refuse):
        # every link starts before the views are checked (their receivers get the start
        # meanwhile), else the tensors are checked first
        early = plan is self._cuts.plan and ready.shapes == self._cuts.shapes
        # the busiest link first (``links``): its start goes first, its receiver's thread
        # takes it first and its buckets are enqueued first (the update ends with it)
        # over broadcast, a push of the same tensors reads where they lie a bucket at a
        # time, as its buckets go (Guard), instead of all of them before the first
        ready.lazy = (
            early and ready.plain and self._transport == "broadcast"
            and self._cuts.where is not None and len(self._cuts.where) == 3
            and all(r in self._cuts.views for r in links)
        )  # fmt: skip
        if not self.point_to_point and not self._cuts.cuts(plan, -1):
            return PushReport(version, 0, 0.0, (), 0, 0, False)
        try:
            if not early:
                ready()
            streams = {r: functools.partial(ready.pieces, r) if early else ready.pieces(r)[0]
                       for r in links}  # fmt: skip
            report = self._push_links(streams, version, timeout, self._one_thread())
        except BaseException:
            self._cuts.forget()  # cut again next time
            raise
        if ready.lazy:
            ready.keep_where()
        if self._moves and moved(ready.tensors, ready.where):
            # the push read the tensors in place and moved their storages into shared
            # memory: where they lie now (new tensors allocated where they were must not
            # match, or the kept views would send the old bytes)
            self._cuts.where = where_of(ready.tensors, ready.plain)
        return report

    def _one_thread(self) -> bool:
        """Whether this thread takes every link's steps in turn: on GPUs (a step enqueues
        GPU work: NCCL's, or cuda_ipc's writes); on the CPU (gloo, shm) the copies are the
        work, and a thread a link runs them side by side (2 -> 2 over gloo, 64 MB: 21-27 ms
        a push, 41 in one thread; ``python benchmarks/weights_sharded.py --transport
        broadcast --point-to-point --senders 2 --receivers 2``)."""
        return self._cuts.on_gpu and self._transport in ("broadcast", "cuda_ipc")

    def _push_links(
        self, streams: dict[int, Any], version: int, timeout: float, one_thread: bool
    ) -> PushReport:
        """Every link's push at once; each is bounded by ``timeout``; the first error, by
        engine rank, is raised once all ended. ``one_thread`` (NCCL: a push's steps only
        enqueue work): this thread takes every link's steps in turn, else each link gets a
        thread (the last this one; on the CPU the copies are the work). Threads fight for
        the GIL: the second link of a rank would start 0.6 ms after the first (four
        H100s)."""
        steps = {r: self._links[r].steps(streams[r], version, timeout) for r in streams}
        reports: dict[int, PushReport] = {}
        errors: dict[int, BaseException] = {}
        if one_thread or len(steps) <= 1:
            take_turns(steps, reports, errors)
        else:
            *others, last = steps
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    len(self._links) - 1, thread_name_prefix=f"rlferry-{self.group}-links"
                )
            futures = {r: self._pool.submit(drain, steps[r]) for r in others}
            try:  # an interrupt (Ctrl-C) goes up at once; the other links end by their timeout
                reports[last] = drain(steps[last])
            except Exception as e:
                errors[last] = e
            for r, f in futures.items():
                try:
                    reports[r] = f.result()
                except BaseException as e:
                    errors[r] = e
        if errors:
            raise errors[min(errors)]
        rs = reports.values()
        return PushReport(
            version, sum(x.bytes for x in rs), max((x.seconds for x in rs), default=0.0),
            tuple(n for x in rs for n in x.receivers), sum(x.tensors for x in rs),
            sum(x.buckets for x in rs), any(x.plan_sent for x in rs),
        )  # fmt: skip

    def statistics(self) -> ShardedSenderStatistics:
        plan = self._plans.get()
        p2p = self.point_to_point
        sent = (
            sum(plan.link_bytes(self.rank, r) for r in self._links)
            if p2p
            else plan.stream_bytes(self.rank)
        )
        return ShardedSenderStatistics(
            rank=self.rank,
            plan=plan.fingerprint,
            plans_computed=self._plans.computed,
            pieces=len(plan.streams[self.rank]),
            stream_bytes=sent,
            receivers=tuple(plan.receivers_of(self.rank)),
            link=None if p2p else self._links[-1].statistics(),
            per_receiver={r: w.statistics() for r, w in self._links.items()} if p2p else {},
        )

    def close(self) -> None:
        """Stop serving: receivers see this rank gone and keep their last whole version."""
        for w in self._links.values():
            w.close()
        self._cuts.views = {}  # they hold the last pushed tensors' memory
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ShardedSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
