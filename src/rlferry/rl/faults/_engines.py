"""The demo's engines, one slot each (``engine{i}``): which engine serves each slot now,
and a new one for a slot whose engine was lost.

A slot's engine is watched from the moment it serves: with the local launcher its
process (``rlferry serve engine``), on Ray its actor (``RayEngine.ended``). When it ends,
the loss is noted (which engine, at which step, why) and a replacement starts under the
same name: a new process (local), or the actor Ray restarts (``max_restarts``). The
replacement joins the trainer ranks' weight senders (``init_weight_transfer``: it holds
no base, the next push to it is whole) and the coordinator (``remove_engine`` of the lost
one, ``add_engine`` of the new one): it gets rollouts once it holds a version the
staleness bound allows, else once an update reached it. Meanwhile the coordinator runs
the lost engine's requests on the others, with their tokens so far.

A weight update that committed on some engines is not a failure of the run; one that
committed nowhere is pushed again once an engine is back. The run fails only when every
slot's engine is lost for good (its replacements used up, or one did not start within
its start timeout), naming every engine and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from rlferry.control import (
    Coordinator,
    EngineError,
    EngineGone,
    EngineStatistics,
    Group,
    UpdateReport,
)
from rlferry.errors import RequestError

log = logging.getLogger("rlferry.rl")

__all__ = ["ENGINE_RESTARTS", "Engines", "Loss", "generating"]

T = TypeVar("T")
ENGINE_RESTARTS = 3
"""How many times a slot's engine is replaced in one run (Ray: the actors' ``max_restarts``)."""
UPDATE_TRIES = 4
"""How many times an update that committed on no engine is pushed, each once an engine is back."""
UPDATE_TIMEOUT = 120.0  # seconds a catch-up may take, as the demo's updates
LOSS_GRACE = 10.0
"""Seconds an update that found no engine waits for the watches to hear their loss (an
engine's process exit reaches the driver after its broken connection may)."""

Start = Callable[[int], Awaitable[Any]]  # a new engine for slot i, serving
# why slot i's engine ended, once it did (None: it stopped as asked, not lost)
Ended = Callable[[int, Any], Awaitable[str | None]]


@dataclasses.dataclass
class Loss:
    """One engine lost during the run, and its replacement."""

    engine: str
    step: int  # the step in progress when it was lost
    why: str
    lost_seconds: float  # since the engines were first watched (just before the first step)
    rejoined_step: int | None = None  # the step in progress when its replacement joined
    rejoined_seconds: float | None = None
    failed: str | None = None  # why no replacement serves in its place


class Engines:
    """The run's engines by slot (:attr:`handles`: the one serving each slot now), each
    watched and replaced when lost (see the module's docstring), ``restarts`` times at most
    (default :data:`ENGINE_RESTARTS`). ``weights``: per slot, the trainer's address its
    engine joins (group ``demo``), or None without weight sync. :attr:`push_at`: the
    trainer's push of a version (for :meth:`batch`'s catch-up), None without weight sync.
    :meth:`close` stops watching and replacing (before the processes stop)."""

    def __init__(
        self, handles: list[Any], *, start: Start, ended: Ended, weights: list[str] | None,
        restarts: int | None = None,
    ) -> None:  # fmt: skip
        self.handles = list(handles)
        self.losses: list[Loss] = []
        self.step = 0
        self._start, self._ended, self._weights = start, ended, weights
        self._restarts = ENGINE_RESTARTS if restarts is None else restarts
        self._used = [0] * len(handles)
        self._dead: dict[str, str] = {}  # engines lost for good: why
        self._failed_in: dict[str, int] = {}  # engines an update failed: its step
        self._behind: dict[str, str] = {}  # at the run's end, not at the last version: why
        self._tasks: set[asyncio.Task[Any]] = set()
        self._replacing: dict[int, asyncio.Task[Any]] = {}
        self._coord: Coordinator | None = None
        self.push_at: Callable[[int], Any] | None = None  # the trainer's push of a version
        # the step of the update that runs (its version: the demo's versions are its
        # steps; it may run into the next step): no catch-up beside it, one push at a time
        self._updating: int | None = None
        self._batching = False  # the driver waits for a batch: the trainer ranks are idle
        self._catching: asyncio.Task[Any] | None = None
        self._failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._failed.add_done_callback(lambda f: f.exception())  # told by guard() to its waiter
        self._heard = asyncio.Event()  # set by every loss
        self._t0 = time.monotonic()
        self._closed = False

    def attach(self, coord: Coordinator) -> None:
        """Start watching every slot's engine; replacements join ``coord``."""
        self._coord = coord
        for i in range(len(self.handles)):
            self._watch(i)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _watch(self, i: int) -> None:
        handle = self.handles[i]

        async def watch() -> None:
            why = await self._ended(i, handle)
            if why is not None and not self._closed and self.handles[i] is handle:
                self.lost(i, why)

        self._spawn(watch())

    def lost(self, i: int, why: str) -> None:
        """Note that slot ``i``'s engine was lost (``why``) and start its replacement."""
        name = self.handles[i].name
        # its update's, if one failed it first or runs
        step = self._failed_in.pop(name, self.step if self._updating is None else self._updating)
        loss = Loss(name, step, why, time.monotonic() - self._t0)
        self.losses.append(loss)
        self._heard.set()
        if self._used[i] >= self._restarts:
            loss.failed = f"its {self._restarts} replacements are used up"
            self._give_up(name, f"{why}; {loss.failed}")
            return
        self._used[i] += 1
        self._replacing[i] = self._spawn(self._replace(i, loss))

    async def _replace(self, i: int, loss: Loss) -> None:
        assert self._coord is not None
        old = self.handles[i]
        try:
            new = await self._start(i)
            if self._weights is not None:  # it holds no base: the next push to it is whole
                await new.init_weight_transfer("demo", self._weights[i])
        except Exception as e:
            loss.failed = f"its replacement did not serve: {type(e).__name__}: {e}"
            self._give_up(loss.engine, f"{loss.why}; {loss.failed}")
            return
        finally:
            self._replacing.pop(i, None)
        if self._closed:
            await new.aclose()
            return
        self.handles[i] = new
        with contextlib.suppress(RequestError):  # not in the fleet any more
            await self._coord.remove_engine(loss.engine, requests="restart")
        self._coord.add_engine(new)
        await old.aclose()
        loss.rejoined_step, loss.rejoined_seconds = self.step, time.monotonic() - self._t0
        self._watch(i)
        self._catch_up()

    def _give_up(self, name: str, why: str) -> None:
        self._dead[name] = why
        if len(self._dead) == len(self.handles) and not self._failed.done():
            text = "; ".join(f"`{n}`: {w}" for n, w in sorted(self._dead.items()))
            self._failed.set_exception(EngineGone(
                ", ".join(sorted(self._dead)), f"every engine of the run is lost: {text}",
                failures=dict(self._dead),
            ))  # fmt: skip

    async def guard(self, call: Coroutine[Any, Any, T]) -> T:
        """``call``'s outcome; if every engine is lost for good first, that error instead.
        ``call`` runs in the caller's task: its result reaches the caller before the tasks
        it woke (the requests an update let go: 11 ms a step of 512 samples on an H200
        host) start, not after, so the next command goes first."""
        if self._failed.done():
            call.close()
            self._failed.result()
        task = asyncio.current_task()
        assert task is not None
        lost = False

        def on_failed(_: asyncio.Future[None]) -> None:
            nonlocal lost
            lost = True
            task.cancel()

        self._failed.add_done_callback(on_failed)
        try:
            return await call
        except asyncio.CancelledError:
            if not lost:
                raise
        finally:
            self._failed.remove_done_callback(on_failed)
            if lost and hasattr(task, "uncancel"):  # Python 3.11+: the cancel was ours
                task.uncancel()
        self._failed.result()
        raise AssertionError("unreachable")  # pragma: no cover

    async def batch(
        self, groups: int, *, timeout: float, trainer_version: int | None = None
    ) -> list[Group]:
        """``coord.batch``; while it waits (the trainer ranks idle: see :meth:`idle`), a
        fleet where no engine serves is caught up. One taken ahead for ``trainer_version``,
        while the ranks train, catches nothing up."""
        assert self._coord is not None
        call = self.guard(
            self._coord.batch(groups, timeout=timeout, trainer_version=trainer_version)
        )  # fmt: skip
        return await (call if trainer_version is not None else self.idle(call))

    async def idle(self, waiting: Awaitable[T]) -> T:
        """Await ``waiting`` (a batch) while the trainer ranks are idle: meanwhile a fleet
        where no engine serves is brought to the trainer's version as soon as a
        replacement joined (``Coordinator.catch_up``: else no batch would come before the
        next update). Returns once no catch-up pushes (the ranks take one command at a
        time)."""
        self._batching = True
        try:
            self._catch_up()
            return await waiting
        finally:
            self._batching = False
            if self._catching is not None:
                await asyncio.wait([self._catching])

    def _catch_up(self) -> None:
        coord = self._coord
        if (
            coord is None or self.push_at is None or not self._batching or self._closed
            or self._updating is not None
            or (self._catching is not None and not self._catching.done())
            or coord.statistics().engines_serving
        ):  # fmt: skip
            return

        async def catch_up() -> None:
            assert coord is not None and self.push_at is not None
            try:
                await coord.catch_up(self.push_at(coord.version), timeout=UPDATE_TIMEOUT)
            except EngineError as e:  # tried again once the next replacement joined
                log.warning("rlferry demo: no engine serves, and none caught up: %s", e)

        self._catching = self._spawn(catch_up())

    async def update(self, push: Any, *, version: int, timeout: float) -> UpdateReport | None:
        """``coord.update_weights`` to ``version``: an update that committed on some engines
        (the coordinator's version is ``version``) is done (the engines lost in it are
        replaced); one that committed nowhere is pushed again once a replacement joined,
        :data:`UPDATE_TRIES` times at most. Its report; None if it committed on some
        engines only (a ``WeightUpdateError`` was heard)."""
        coord = self._coord
        assert coord is not None
        self._failed_in.clear()  # the last update's: their losses were heard since
        self._updating = version
        try:
            return await self._update(coord, push, version, timeout)
        finally:
            self._updating = None
            self._catch_up()  # a batch that waits while no engine serves

    async def _update(
        self, coord: Any, push: Any, version: int, timeout: float
    ) -> UpdateReport | None:
        for tries in range(1, UPDATE_TRIES + 1):
            try:
                return await self.guard(
                    coord.update_weights(push, version=version, timeout=timeout)
                )
            except EngineError as e:
                for name in e.failures:
                    self._failed_in.setdefault(name, version)  # the update's step
                if coord.version >= version:  # committed on the engines that serve
                    return None
                if tries == UPDATE_TRIES:
                    raise
                if not self._replacing:  # its watch may not have heard the loss yet
                    await self.guard(self._loss_heard(LOSS_GRACE))
                if self._failed.done():  # every engine lost for good: that is the error
                    self._failed.result()
                if not self._replacing:
                    raise
            await self.guard(self._joined())
        raise AssertionError("unreachable")  # the last try returned or raised

    async def _loss_heard(self, timeout: float) -> None:
        """Return once a loss was heard, or after ``timeout`` seconds."""
        self._heard.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._heard.wait(), timeout)

    async def _joined(self) -> None:
        """Return once the replacements in progress ended (at once if none)."""
        if self._replacing:
            await asyncio.wait(list(self._replacing.values()))

    async def at(self, version: int) -> list[Any]:
        """At the run's end: the engines that serve ``version`` (the trainer's last), once
        the replacements in progress joined; each other slot's engine and what it holds
        go to :meth:`summary` (a replacement that joined after the last update holds the
        checkpoint's weights)."""
        await self.guard(self._joined())
        held = await asyncio.gather(
            *(e.get_weight_version() for e in self.handles), return_exceptions=True
        )  # fmt: skip
        out = []
        for e, v in zip(self.handles, held, strict=True):
            if v == version:
                out.append(e)
            elif isinstance(v, BaseException) and not isinstance(v, Exception):
                raise v
            else:
                self._behind[e.name] = f"{type(v).__name__}: {v}" if isinstance(
                    v, Exception) else f"at version {v}"  # fmt: skip
        if not out:
            text = "; ".join(f"`{n}`: {w}" for n, w in self._behind.items())
            raise EngineGone(
                ", ".join(self._behind), f"no engine serves version {version} at the run's "
                f"end: {text}", failures=dict(self._behind),
            )  # fmt: skip
        return out

    async def statistics(self) -> list[EngineStatistics | None]:
        """Every slot's engine's statistics, asked at once (None: it did not answer)."""
        got = await asyncio.gather(
            *(e.statistics() for e in self.handles), return_exceptions=True
        )  # fmt: skip
        out: list[EngineStatistics | None] = []
        for g in got:
            if isinstance(g, BaseException) and not isinstance(g, Exception):
                raise g
            out.append(g if isinstance(g, EngineStatistics) else None)
        return out

    def summary(self) -> dict[str, Any]:
        """The report's entries: how many engines were lost, and each loss."""
        return {
            "engines lost": len(self.losses),
            "engine_losses": [dataclasses.asdict(x) for x in self.losses],
            "engines not at the last version": dict(self._behind),
        }

    async def close(self) -> None:
        """Stop watching and replacing (the engines themselves are the launcher's)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def generating(before: list[Any], now: list[Any]) -> float:
    """The engines' generating seconds between two :meth:`Engines.statistics` (a slot that
    did not answer counts nothing; a replacement counts from its start)."""
    out = 0.0
    for a, b in zip(before, now, strict=True):
        if b is not None:
            since = a.step_seconds if a is not None and a.step_seconds <= b.step_seconds else 0.0
            out += b.step_seconds - since
    return out
