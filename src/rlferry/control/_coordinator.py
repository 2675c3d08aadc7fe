"""The coordinator: routes rollouts to engines, bounds staleness, runs weight updates.

Everything runs on one asyncio loop and waits on events: a ``submit`` over the
staleness bound waits on the coordinator's condition (woken by a finished rollout or a
new version), a rollout waits on its engine's ``generate`` (the engine pushes the
completion), a ``batch`` waits for finished groups. Nothing polls.

A weight update is one call: pause every engine (``keep``, ``abort`` or ``wait``), push
through the trainer's ``WeightSender``, have every engine serve the new version, resume
every engine in ``finally``. An engine that fails any step is named in the
:class:`EngineError` raised at the end, after the others resumed on the new version;
it gets no rollouts until it serves a later version whole.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec

from ._engine import (
    Completion,
    Engine,
    EngineError,
    FinishReason,
    GenerateRequest,
    PauseMode,
    SamplingParams,
)
from ._http import RemoteEngine
from ._staleness import Staleness

__all__ = ["Coordinator", "CoordinatorStatistics", "Group", "UpdateReport"]

T = TypeVar("T")
_ids = itertools.count(1)
_PUSH = " push"  # the key of a push's own failure (no engine has a name with a space first)


class Group(msgspec.Struct, frozen=True, kw_only=True):
    """The ``n`` completions of one submitted prompt (a GRPO group when ``n > 1``)."""

    group: Any
    prompt_ids: list[int]
    completions: list[Completion]

    @property
    def version_start(self) -> int:
        """The oldest weight version any of its tokens came from."""
        return min(c.version_start for c in self.completions)

    @property
    def version_end(self) -> int:
        return max(c.version_end for c in self.completions)


class UpdateReport(msgspec.Struct, frozen=True, kw_only=True):
    """One weight update: its version and how long each phase took."""

    version: int
    engines: tuple[str, ...]
    pause_seconds: float
    push_seconds: float
    finish_seconds: float
    resume_seconds: float
    seconds: float


class CoordinatorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """The coordinator's state and counters (samples, not groups, unless named)."""

    version: int
    max_staleness: int
    engines: int
    engines_serving: int
    running: int
    ready_groups: int
    accepted: int
    consumed: int
    dropped: int
    regenerated: int
    capacity: int
    staleness_mean: float
    staleness_max: int
    updates: int
    pause_seconds: float
    push_seconds: float
    update_seconds: float
    waiting_submits: int


@dataclass
class _Member:
    engine: Engine
    running: int = 0
    broken: str | None = None  # why it gets no rollouts (a failed update), until it recovers
    own: str | None = None  # the name the engine gives itself (its weight receiver's name)


@dataclass
class _Unit:
    id: int
    group: Any
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    future: asyncio.Future[Group]
    completions: list[Completion | None] = field(default_factory=list)
    ended: int = 0  # samples finished or failed


class Coordinator:
    """Drives :class:`Engine` s (objects, or URLs of engines served by ``rlferry serve
    engine``) for a trainer.

    ``batch_size``: samples per training step; ``max_staleness`` (eta): how many
    versions a trained sample may lag (0 = synchronous); admission follows AReaL's
    rule, at most ``(eta + v + 1) * batch_size`` samples accepted or running at
    trainer version ``v``. ``stale``: what :meth:`batch` does with a group that lags
    more when the trainer takes it, ``"drop"`` it or ``"regenerate"`` it.
    ``max_running``: samples generating at once, at most. ``version``: the trainer's
    version the engines start at.
    """

    def __init__(
        self,
        engines: Iterable[Engine | str],
        *,
        batch_size: int,
        max_staleness: int = 1,
        stale: Literal["drop", "regenerate"] = "drop",
        max_running: int | None = None,
        version: int = 0,
    ) -> None:
        if stale not in ("drop", "regenerate"):
            raise ValueError(f"stale: expected 'drop' or 'regenerate', got {stale!r}")
        self._bound = Staleness(batch_size, max_staleness, max_running, version)
        self.stale = stale
        self._members: dict[str, _Member] = {}
        self._changed = asyncio.Event()  # set and replaced on every change waiters care about
        for engine in engines:
            self.add_engine(engine)
        self._ready: deque[_Unit] = deque()
        self._running = asyncio.Event()  # set while no update holds rollouts back
        self._running.set()
        self._abort_epoch = 0  # bumped by an update in abort mode: its aborts are continued
        self._tasks: set[asyncio.Task[Any]] = set()
        self._waiting_submits = 0
        self._updates = 0
        self._seconds = {"pause": 0.0, "push": 0.0, "update": 0.0}
        self._closed = False

    # -- engines ------------------------------------------------------------------------
    def add_engine(self, engine: Engine | str) -> None:
        """Route rollouts to ``engine`` from now on (its name must be unique); a URL is an
        engine served by ``rlferry serve engine`` (a :class:`RemoteEngine`)."""
        if isinstance(engine, str):
            engine = RemoteEngine(engine)
        if not isinstance(engine, Engine):
            raise TypeError(
                f"engine: expected an rlferry.control.Engine (HFEngine, RemoteEngine, ...), "
                f"got {type(engine).__name__}"
            )
        if engine.name in self._members:
            raise ValueError(f"engine `{engine.name}`: a coordinator's engines need unique names")
        self._members[engine.name] = _Member(engine)
        self._notify()

    @property
    def version(self) -> int:
        """The trainer's version: the last update's."""
        return self._bound.version

    def _pick(self) -> _Member | None:
        serving = [m for m in self._members.values() if m.broken is None]
        return min(serving, key=lambda m: m.running) if serving else None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, ready: Callable[[], T | None], timeout: float | None, what: str) -> T:
        """Wait on the coordinator's events until ``ready()`` gives something."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (result := ready()) is None:
            if self._closed:
                raise EngineError("coordinator", f"closed while waiting for {what}")
            event = self._changed
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"{what}: not within {timeout} s")
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                continue  # the loop's check raises with the reason
        return result

    # -- rollouts -----------------------------------------------------------------------
    async def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        n: int = 1,
        group: Any = None,
        timeout: float | None = None,
    ) -> asyncio.Future[Group]:
        """Admit ``n`` samples of ``prompt_ids`` (waiting, by event, while the staleness
        bound is full) and start them on the least-loaded engines; the future resolves
        with the :class:`Group` once all ``n`` finished.

        Raises:
            TimeoutError: the bound stayed full for ``timeout`` seconds (the trainer
                must take batches and update its version for room to come).
            ValueError: bad arguments.
        """
        params = params or SamplingParams()
        request = GenerateRequest(request_id="check", prompt_ids=list(prompt_ids), params=params)
        most = self._bound.batch_size * (self._bound.max_staleness + 1)
        if type(n) is not int or not 1 <= n <= most:
            raise ValueError(
                f"n: expected an int in [1, {most}] (batch_size x (max_staleness + 1)), got {n!r}"
            )
        self._waiting_submits += 1
        try:
            await self._until(
                lambda: True if self._bound.capacity() >= n else None,
                timeout,
                f"admission of {n} samples (capacity {self._bound.capacity()} at version "
                f"{self.version}, max_staleness {self._bound.max_staleness})",
            )
        finally:
            self._waiting_submits -= 1
        unit = _Unit(
            next(_ids), group, request.prompt_ids, params, n,
            asyncio.get_running_loop().create_future(), [None] * n,
        )  # fmt: skip
        self._start(unit)
        return unit.future

    def _start(self, unit: _Unit) -> None:
        self._bound.admit(unit.n)
        unit.completions = [None] * unit.n
        unit.ended = 0
        for i in range(unit.n):
            task = asyncio.ensure_future(self._rollout(unit, i))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._notify()

    async def _rollout(self, unit: _Unit, i: int) -> None:
        """One sample: generated on an engine; continued on one after an abort of an
        update in ``abort`` mode, or after its engine failed (prompt + the tokens so far)."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason: FinishReason = "length"
        engine_name = ""
        try:
            while len(tokens) < unit.params.max_tokens:
                await self._running.wait()
                epoch = self._abort_epoch
                member = await self._until(self._pick, None, "an engine that serves")
                params = msgspec.structs.replace(
                    unit.params, max_tokens=unit.params.max_tokens - len(tokens)
                )
                request = GenerateRequest(
                    request_id=f"r{unit.id}-{i}-{len(tokens)}",
                    prompt_ids=unit.prompt_ids + tokens,
                    params=params,
                )
                member.running += 1
                try:
                    done = await member.engine.generate(request)
                except EngineError as e:
                    member.broken = member.broken or e.reason
                    self._notify()
                    continue  # its tokens so far go on elsewhere
                finally:
                    member.running -= 1
                tokens += done.token_ids
                logprobs += done.logprobs
                versions += done.versions
                reason, engine_name = done.finish_reason, done.engine or member.engine.name
                if reason != "abort" or self._abort_epoch == epoch:
                    break  # an abort by an update in abort mode goes on; others end here
        except BaseException as e:
            self._ended(unit, None, e)
            raise
        done_ = Completion(
            request_id=f"r{unit.id}-{i}", prompt_ids=unit.prompt_ids, token_ids=tokens,
            logprobs=logprobs, versions=versions, finish_reason=reason, engine=engine_name,
        )  # fmt: skip
        unit.completions[i] = done_
        self._ended(unit, done_, None)

    def _ended(self, unit: _Unit, done: Completion | None, error: BaseException | None) -> None:
        """A sample of ``unit`` finished or failed; the group resolves once all ended."""
        unit.ended += 1
        self._bound.finish(accepted=done is not None)
        if error is not None and not unit.future.done():
            if isinstance(error, asyncio.CancelledError):
                unit.future.cancel()  # closed: nobody needs to hear of it
            else:
                unit.future.set_exception(error)
        if unit.ended == unit.n:
            if unit.future.done():  # it failed: its finished samples will not be trained
                self._bound.discard(sum(c is not None for c in unit.completions))
            else:
                finished = [c for c in unit.completions if c is not None]
                group = Group(group=unit.group, prompt_ids=unit.prompt_ids, completions=finished)
                self._ready.append(unit)
                unit.future.set_result(group)
        self._notify()

    async def batch(self, groups: int, *, timeout: float | None = None) -> list[Group]:
        """Take ``groups`` finished groups for one training step, oldest first.

        A group that lags more than ``max_staleness`` versions now is dropped or
        regenerated (``stale``), never returned: every returned group's
        ``version_start`` is at least ``version - max_staleness``.

        Raises:
            TimeoutError: not enough fresh groups within ``timeout``.
        """
        if type(groups) is not int or groups < 1:
            raise ValueError(f"groups: expected an int >= 1, got {groups!r}")

        def ready() -> list[_Unit] | None:
            self._sift()
            if len(self._ready) < groups:
                return None
            return [self._ready.popleft() for _ in range(groups)]

        units = await self._until(ready, timeout, f"{groups} finished groups")
        out = []
        for unit in units:
            group = unit.future.result()
            lag = self._bound.lag(group.version_start)
            self._bound.consume(unit.n, lag)
            out.append(group)
        self._notify()
        return out

    def _sift(self) -> None:
        """Drop or regenerate the ready groups that lag too much now."""
        keep: deque[_Unit] = deque()
        while self._ready:
            unit = self._ready.popleft()
            if not self._bound.stale(unit.future.result().version_start):
                keep.append(unit)
                continue
            self._bound.discard(unit.n)
            if self.stale == "regenerate":
                self._bound.regenerated += unit.n
                again = _Unit(
                    unit.id, unit.group, unit.prompt_ids, unit.params, unit.n,
                    asyncio.get_running_loop().create_future(),
                )  # fmt: skip
                self._start(again)
        self._ready = keep

    # -- weight updates ---------------------------------------------------------------------
    async def update_weights(
        self,
        push: Callable[[float], Any],
        *,
        version: int,
        mode: PauseMode = "keep",
        timeout: float = 60.0,
    ) -> UpdateReport:
        """Pause every engine, run ``push(seconds_left)`` (a function, run in a thread: e.g.
        ``lambda t: sender.push(model.state_dict().items(), version=v, timeout=t)``; or a
        coroutine function, awaited), have every engine serve ``version``, and resume
        every engine whatever happened.

        Raises:
            EngineError: an engine failed a step (pause, load, commit, resume) or did not
                finish it in time; the message names each such engine and its reason.
                The others serve ``version``; the trainer's version is ``version`` either
                way.
        """
        if type(version) is not int or version <= self.version:
            raise ValueError(
                f"version: expected an int above the current {self.version}, got {version!r}"
            )
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"mode: expected 'keep', 'abort' or 'wait', got {mode!r}")
        t0 = time.monotonic()
        deadline = t0 + timeout
        members = list(self._members.values())
        failed: dict[str, str] = {}
        if mode == "abort":
            self._abort_epoch += 1
        self._running.clear()
        marks = [t0]
        try:
            await self._each(
                [m for m in members if m.own is None], self._learn_name, "statistics",
                deadline, failed,
            )  # fmt: skip
            await self._each(members, lambda m: m.engine.pause(mode), "pause", deadline, failed)
            await self._each(
                members, lambda m: m.engine.start_weight_update(), "start_weight_update",
                deadline, failed,
            )  # fmt: skip
            marks.append(time.monotonic())
            try:
                left = max(0.001, deadline - time.monotonic())
                pushing = push(left) if inspect.iscoroutinefunction(push) else (
                    asyncio.to_thread(push, left))  # fmt: skip
                await asyncio.wait_for(pushing, left + 1.0)
            except asyncio.TimeoutError:
                failed.setdefault(_PUSH, f"did not return within {timeout} s")
            except Exception as e:
                by_own = {m.own: m.engine.name for m in members if m.own is not None}
                for name, why in getattr(e, "failures", {}).items():
                    failed.setdefault(by_own.get(name, name), why)
                if not getattr(e, "failures", None):
                    failed.setdefault(_PUSH, f"{type(e).__name__}: {e}")
            marks.append(time.monotonic())
            live = [m for m in members if m.engine.name not in failed]
            await self._each(
                live, lambda m: m.engine.finish_weight_update(version), "finish_weight_update",
                deadline, failed,
            )  # fmt: skip
            marks.append(time.monotonic())
        finally:
            self._bound.version = max(self._bound.version, version)
            resume_deadline = max(deadline, time.monotonic() + 10.0)
            await self._each(members, lambda m: m.engine.resume(), "resume", resume_deadline,
                             failed)  # fmt: skip
            for m in members:
                m.broken = failed.get(m.engine.name)
            self._running.set()
            self._notify()
        end = time.monotonic()
        marks += [end] * (5 - len(marks))
        self._updates += 1
        self._seconds["pause"] += marks[1] - marks[0]
        self._seconds["push"] += marks[2] - marks[1]
        self._seconds["update"] += end - t0
        if failed:
            pushed = failed.pop(_PUSH, None)
            text = "; ".join(f"`{name}`: {why}" for name, why in failed.items())
            if pushed is not None:
                text = f"the push: {pushed}" + (f"; {text}" if text else "")
            raise EngineError(
                ", ".join(failed) or "(all)",
                f"weight update to version {version} failed: {text}",
                failed,
            )
        return UpdateReport(
            version=version, engines=tuple(m.engine.name for m in members),
            pause_seconds=marks[1] - marks[0], push_seconds=marks[2] - marks[1],
            finish_seconds=marks[3] - marks[2], resume_seconds=end - marks[3],
            seconds=end - t0,
        )  # fmt: skip

    @staticmethod
    async def _learn_name(m: _Member) -> None:
        """The name the engine gives itself: a push names failed receivers by it."""
        m.own = (await m.engine.statistics()).name

    async def _each(
        self,
        members: list[_Member],
        call: Callable[[_Member], Awaitable[Any]],
        step: str,
        deadline: float,
        failed: dict[str, str],
    ) -> None:
        """``call`` every member not failed yet, at once, until ``deadline``; a failure or
        a member late is recorded in ``failed`` with the step's name."""
        members = [m for m in members if m.engine.name not in failed]

        async def one(m: _Member) -> None:
            try:
                await asyncio.wait_for(call(m), max(0.001, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                failed.setdefault(m.engine.name, f"{step} did not finish in time")
            except Exception as e:
                why = e.reason if isinstance(e, EngineError) else f"{type(e).__name__}: {e}"
                failed.setdefault(m.engine.name, f"{step} failed: {why}")

        await asyncio.gather(*(one(m) for m in members))

    # -- the rest -------------------------------------------------------------------------
    def statistics(self) -> CoordinatorStatistics:
        b = self._bound
        return CoordinatorStatistics(
            version=b.version, max_staleness=b.max_staleness, engines=len(self._members),
            engines_serving=sum(m.broken is None for m in self._members.values()),
            running=b.running, ready_groups=len(self._ready), accepted=b.accepted,
            consumed=b.consumed, dropped=b.dropped, regenerated=b.regenerated,
            capacity=b.capacity(), staleness_mean=b.lag_sum / b.consumed if b.consumed else 0.0,
            staleness_max=b.lag_max, updates=self._updates,
            pause_seconds=self._seconds["pause"], push_seconds=self._seconds["push"],
            update_seconds=self._seconds["update"], waiting_submits=self._waiting_submits,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The version and counters to restore after a restart (so staleness stays bounded)."""
        return self._bound.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._bound.load_state_dict(state)
        self._notify()

    async def close(self) -> None:
        """Cancel the rollouts in flight; waiting calls raise."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        self._notify()
