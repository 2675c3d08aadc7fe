"""The coordinator: routes rollouts to engines, bounds staleness, runs weight updates.

Everything runs on one asyncio loop and waits on events (``_changes.py``): a ``submit``
over the staleness bound waits on the coordinator's event (set by a finished rollout or a
new version), a rollout waits on its engine's ``generate`` (the engine pushes the
completion; ``_samples.py`` runs each sample across the engines), a ``batch`` waits for
finished groups. Nothing polls.

A weight update is one call: pause every engine (``keep``, ``abort`` or ``wait``), push
through the trainer's ``WeightSender``, have every engine serve the new version, resume
every engine in ``finally`` (``_update.py`` says whose fault a failure is). Membership is
explicit (``_fleet.py``): engines join with ``add_engine``, leave with ``remove_engine``,
and a request an engine refuses fails that request, never the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from rlferry.errors import RequestError
from rlferry.wire import SecurityError
from rlferry.wire.lowlevel import AsyncResource

from ._changes import Changes
from ._engine import Engine, GenerateRequest, PauseMode, SamplingParams
from ._errors import EngineClosed, EngineError
from ._fleet import Fleet, Moved
from ._records import CoordinatorStatistics, Group
from ._samples import Samples
from ._staleness import Staleness
from ._update import UpdateReport, run_update

__all__ = ["Coordinator", "CoordinatorStatistics", "Group", "UpdateReport"]

log = logging.getLogger("rlferry.control")
ENGINE_TIMEOUT = 600.0
"""Seconds a sample waits for an engine that serves before its group fails."""


class Coordinator(AsyncResource):
    """Drives :class:`Engine` s (objects, or URLs of engines served by ``rlferry serve
    engine``) for a trainer.

    ``engines``: the fleet to start with (at least one; more join with
    :meth:`add_engine`). ``batch_size``: samples per training step; ``max_staleness``
    (eta): how many versions a trained sample may lag (0 = synchronous); admission
    follows AReaL's rule, at most ``(eta + v + 1) * batch_size`` samples accepted or
    running at trainer version ``v``. ``stale``: what :meth:`batch` does with a group that
    lags more when the trainer takes it, ``"drop"`` it or ``"regenerate"`` it.
    ``max_running``: samples generating at once, at most. ``version``: the trainer's
    version the engines start at. ``engine_timeout``: seconds a sample waits for an
    engine that serves before its group fails (naming each engine and why it does not
    serve).

    Faults: a request an engine refuses (:class:`RequestError`) fails that request's
    group, once, and the engine keeps serving; :meth:`submit` checks prompts against the
    limits the engines announce before anything is queued. An engine fault (gone, a
    failed step) takes that engine out of rotation, its samples continue on the others
    with their tokens so far; ``remove_engine`` and ``add_engine`` change the fleet.

    End of life: :meth:`aclose` (or ``async with``) cancels the rollouts in flight and
    closes the engines it made from URLs; calls waiting on it and every later call (but
    :meth:`statistics` and :meth:`state_dict`) raise :class:`EngineClosed` naming
    ``coordinator``.
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
        engine_timeout: float = ENGINE_TIMEOUT,
    ) -> None:
        if stale not in ("drop", "regenerate"):
            raise RequestError(f"stale: expected 'drop' or 'regenerate', got {stale!r}")
        if not isinstance(engine_timeout, (int, float)) or not engine_timeout > 0:
            raise RequestError(f"engine_timeout: expected seconds > 0, got {engine_timeout!r}")
        self._bound = Staleness(batch_size, max_staleness, max_running, version)
        self.stale = stale
        self._fleet = Fleet()
        self._changes = Changes(self._fleet.describe)
        self._samples = Samples(self._fleet, self._bound, self._changes, float(engine_timeout))
        for engine in engines:
            self._fleet.add(engine)
        if not self._fleet.members:
            raise RequestError(
                "engines: expected at least one engine, got none (pass HFEngine objects, "
                "RemoteEngine objects or URLs of `rlferry serve engine`; more can join later "
                "with add_engine)"
            )
        self._waiting_submits = 0
        self._updates = 0
        self._seconds = {"pause": 0.0, "push": 0.0, "update": 0.0}

    # -- engines ------------------------------------------------------------------------
    def add_engine(self, engine: Engine | str) -> None:
        """Add ``engine`` to the fleet (a URL is an engine served by ``rlferry serve
        engine``, a :class:`RemoteEngine`). Its name must be new, or that of a broken
        engine, which it replaces (a server that restarted). It gets rollouts once it
        answers ``statistics()`` with a version the fleet's staleness bound allows; else
        once an ``update_weights`` reached it (join it to the trainer's sender first)."""
        self._check_open("add_engine")
        self._fleet.add(engine)
        self._changes.notify()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # asked on the first submit or update
        self._samples.spawn(self._settle())

    async def remove_engine(
        self, name: str, *, requests: Moved = "continue", timeout: float = 10.0
    ) -> None:
        """Take the engine ``name`` out of the fleet: no rollouts go to it from now on and
        updates no longer name it; the engine itself is not closed. Its requests in flight
        end there and go on elsewhere: with their tokens and per-token versions so far
        (``"continue"``: aborted on the engine first, within ``timeout``) or from their
        prompts again (``"restart"``). A request the engine does not give back in time
        restarts from the tokens it had before it went there."""
        self._check_open("remove_engine")
        if requests not in ("continue", "restart"):
            raise RequestError(f"requests: expected 'continue' or 'restart', got {requests!r}")
        member = self._fleet.remove(name, requests)
        self._changes.notify()
        calls = dict(member.calls)
        if requests == "continue" and calls and member.state != "broken":
            try:
                await asyncio.wait_for(member.engine.abort_requests(list(calls)), timeout)
                await asyncio.wait([c.returned for c in calls.values()], timeout=timeout)
            except (EngineError, SecurityError, asyncio.TimeoutError) as e:
                log.warning("remove_engine(%r): its requests did not come back (%s); they "
                            "restart elsewhere", name, e)  # fmt: skip
        for call in calls.values():
            if not call.returned.done():  # what did not come back goes on elsewhere
                call.taken = True
                call.task.cancel()
        if member.owned:  # made here from a URL: nobody else can close it
            await _aclose(member.engine)

    async def _settle(self) -> None:
        """Ask every engine added since the last time for its name, version and limits."""
        await self._fleet.settle(self.version, self._bound.max_staleness)
        self._changes.notify()

    @property
    def engine_timeout(self) -> float:
        """Seconds a sample waits for an engine that serves before its group fails."""
        return self._samples.engine_timeout

    @engine_timeout.setter
    def engine_timeout(self, seconds: float) -> None:
        self._samples.engine_timeout = seconds

    @property
    def version(self) -> int:
        """The trainer's version: that of the last update any engine committed."""
        return self._bound.version

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
        with the :class:`Group` once all ``n`` finished, or fails with the first
        sample's error (a :class:`RequestError`, or a :class:`CoordinatorTimeout` naming
        each engine and why it does not serve when none served within ``engine_timeout``;
        logged once as well).

        Raises:
            RequestError: a prompt no engine of the fleet can run (a token id outside the
                smallest vocabulary, prompt + ``max_tokens`` beyond the smallest context
                the engines announce): nothing was queued.
            CoordinatorTimeout: (a ``TimeoutError``) the bound stayed full for ``timeout``
                seconds (the trainer must take batches and update its version for room to
                come).
            EngineClosed: the coordinator was closed.
            ValueError: bad arguments.
        """
        self._check_open("submit")
        params = params or SamplingParams()
        prompt = GenerateRequest(request_id="check", prompt_ids=list(prompt_ids)).prompt_ids
        most = self._bound.batch_size * (self._bound.max_staleness + 1)
        if type(n) is not int or not 1 <= n <= most:
            raise RequestError(
                f"n: expected an int in [1, {most}] (batch_size x (max_staleness + 1)), got {n!r}"
            )
        await self._settle()
        self._fleet.check_prompt(prompt, params.max_tokens)
        self._waiting_submits += 1
        try:
            await self._changes.until(
                lambda: True if self._bound.capacity() >= n else None,
                timeout,
                f"admission of {n} samples (capacity {self._bound.capacity()} at version "
                f"{self.version}, max_staleness {self._bound.max_staleness})",
            )
        finally:
            self._waiting_submits -= 1
        return self._samples.submit(group, prompt, params, n).future

    async def batch(
        self, groups: int, *, timeout: float | None = None, trainer_version: int | None = None
    ) -> list[Group]:
        """Take ``groups`` finished groups for one training step, oldest first.

        A group's lag is counted against the weights that train it: ``trainer_version``,
        or the version now (None). Give ``version + 1`` to take the next step's batch while
        this step trains, before its update (the update's push must end before that batch
        trains). A group that lags more than ``max_staleness`` is dropped or regenerated
        (``stale``), never returned: every returned group's ``version_start`` is at least
        ``trainer_version - max_staleness``.

        Raises:
            CoordinatorTimeout: (a ``TimeoutError``) not enough fresh groups within
                ``timeout``.
            EngineClosed: the coordinator was closed.
        """
        self._check_open("batch")
        if type(groups) is not int or groups < 1:
            raise RequestError(f"groups: expected an int >= 1, got {groups!r}")
        if trainer_version is not None and (
            type(trainer_version) is not int or trainer_version < self.version
        ):
            raise RequestError(
                f"trainer_version: expected None or an int >= the version ({self.version}), "
                f"got {trainer_version!r} (the version of the weights that will train the "
                f"batch: None for those now, {self.version + 1} to take it before the update)"
            )
        regenerate = self.stale == "regenerate"
        units = await self._changes.until(
            lambda: self._samples.take(groups, regenerate, trainer_version),
            timeout,
            f"{groups} finished groups",
        )
        out = []
        for unit in units:
            group = unit.future.result()
            lag = self._bound.lag(group.version_start, trainer_version)
            self._bound.consume(unit.n, lag)
            out.append(group)
        self._changes.notify()
        return out

    # -- weight updates ---------------------------------------------------------------------
    async def update_weights(
        self,
        push: Callable[[float], Any],
        *,
        version: int,
        mode: PauseMode = "keep",
        timeout: float = 60.0,
    ) -> UpdateReport:
        """Pause every engine that serves or lags, run ``push(seconds_left)`` (a function,
        run in a thread: e.g. ``lambda t: sender.push(model.state_dict().items(),
        version=v, timeout=t)``; or a coroutine function, or a function that returns an
        awaitable, awaited), have each engine serve what it committed, and resume every
        engine whatever happened.

        Raises:
            WeightUpdateError: (an :class:`EngineError`) a step failed; its ``stage``
                and ``failures`` name where and only the parties at fault (engines, or
                ``push``); every other engine serves its last whole version. The
                trainer's version is ``version`` if any engine committed it, else
                unchanged (push the same version again).
            EngineError: no engine in the fleet can be updated (each is broken).
        """
        self._check_open("update_weights")
        if type(version) is not int or version <= self.version:
            raise RequestError(
                f"version: expected an int above the current {self.version}, got {version!r}"
            )
        outcome = await self._update(push, version, mode, timeout, "update")
        self._updates += 1
        if isinstance(outcome, EngineError):
            raise outcome
        self._seconds["pause"] += outcome.pause_seconds
        self._seconds["push"] += outcome.push_seconds
        self._seconds["update"] += outcome.seconds
        return outcome

    async def catch_up(
        self, push: Callable[[float], Any], *, mode: PauseMode = "keep", timeout: float = 60.0
    ) -> UpdateReport:
        """Push the trainer's current version again: an engine that is behind (one added
        in place of a lost one, holding older weights) serves once it committed it; an
        engine that holds it already loads the same bytes. For a fleet where no engine
        serves, so that no batch can come before the next update. ``push`` pushes the
        weights of :attr:`version` (the trainer has not stepped since); the rest is
        :meth:`update_weights`', errors included."""
        self._check_open("catch_up")
        outcome = await self._update(push, self.version, mode, timeout, "catch_up")
        if isinstance(outcome, EngineError):
            raise outcome
        return outcome

    async def _update(
        self, push: Callable[[float], Any], version: int, mode: PauseMode, timeout: float,
        what: str,
    ) -> UpdateReport | EngineError:  # fmt: skip
        """Run one update of the fleet to ``version``; the trainer's version follows it."""
        if mode not in ("keep", "abort", "wait"):
            raise RequestError(f"mode: expected 'keep', 'abort' or 'wait', got {mode!r}")
        await self._settle()
        if not any(m.state in ("serving", "behind") for m in self._fleet):
            raise EngineError(
                "coordinator", f"{what} to version {version}: no engine to update "
                f"({self._fleet.describe()}; add_engine one that is back)",
            )  # fmt: skip
        if mode == "abort":
            self._samples.abort_epoch += 1
        self._samples.running.clear()
        try:
            after, outcome = await run_update(
                self._fleet, push, version=version, current=self.version,
                max_staleness=self._bound.max_staleness, mode=mode, timeout=timeout,
            )  # fmt: skip
            self._bound.version = after
        finally:
            self._samples.running.set()
            self._changes.notify()
        return outcome

    # -- the rest -------------------------------------------------------------------------
    def statistics(self) -> CoordinatorStatistics:
        b = self._bound
        return CoordinatorStatistics(
            version=b.version, max_staleness=b.max_staleness, engines=len(self._fleet.members),
            engines_serving=self._fleet.serving(),
            running=b.running, ready_groups=len(self._samples.ready), accepted=b.accepted,
            consumed=b.consumed, dropped=b.dropped, regenerated=b.regenerated,
            capacity=b.capacity(), staleness_mean=b.lag_sum / b.consumed if b.consumed else 0.0,
            staleness_max=b.lag_max, updates=self._updates,
            pause_seconds=self._seconds["pause"], push_seconds=self._seconds["push"],
            update_seconds=self._seconds["update"], waiting_submits=self._waiting_submits,
            failed_groups=self._samples.failed_groups,
            not_serving={m.name: f"{m.state}: {m.why}" for m in self._fleet if m.state != "serving"}
            | self._fleet.left,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The version and counters to restore after a restart (so staleness stays bounded)."""
        return self._bound.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_open("load_state_dict")
        self._bound.load_state_dict(state)
        self._changes.notify()

    # -- end of life ----------------------------------------------------------------------
    def _check_open(self, call: str) -> None:
        if self._changes.closed:
            raise EngineClosed("coordinator", f"{call} after aclose() (make a new Coordinator)")

    async def aclose(self) -> None:
        """Cancel the rollouts in flight; waiting calls raise :class:`EngineClosed`. The
        engines made here from URLs are closed; engines passed as objects stay open (they
        are the caller's). A second call does nothing."""
        if self._changes.closed:
            return
        self._changes.closed = True
        self._samples.cancel()
        self._changes.notify()
        for m in self._fleet:
            if m.owned:
                await _aclose(m.engine)


async def _aclose(engine: Engine) -> None:
    """Close an engine made from a URL (a ``RemoteEngine``: its HTTP client)."""
    closing = getattr(engine, "aclose", None)
    if closing is not None:
        await closing()
