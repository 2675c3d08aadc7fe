"""The samples of the submitted prompts, each generated across the fleet's engines.

A submitted prompt is a :class:`Unit` of ``n`` samples (a GRPO group when ``n > 1``).
Each sample runs on the serving engine with the fewest requests in flight; it goes on
elsewhere with its tokens and per-token versions so far after an abort by an update in
``abort`` mode or a removal (``remove_engine(requests="continue")``), and from the
tokens it had before it went there after its engine failed. The unit resolves once every
sample ended: with its :class:`Group`, or with the first sample's error (a request the
engine refused, or no engine served within ``engine_timeout``), logged once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlferry.wire import SecurityError

from ._changes import Changes
from ._engine import Completion, FinishReason, GenerateRequest, SamplingParams
from ._errors import EngineError
from ._fleet import Call, Fleet, Member
from ._records import Group
from ._staleness import Staleness

__all__ = ["Samples", "Unit"]

log = logging.getLogger("rlferry.control")
_ids = itertools.count(1)


@dataclass
class Unit:
    """A submitted prompt's ``n`` samples, and the future of their group."""

    id: int
    group: Any
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    future: asyncio.Future[Group]
    completions: list[Completion | None] = field(default_factory=list)
    ended: int = 0  # samples finished or failed
    version_start: int = 0  # its group's, once every sample finished


class Samples:
    """Runs the samples of every unit on ``fleet`` (each a task of its own), within the
    staleness ``bound``; the finished units wait in :attr:`ready` for the trainer.
    ``running`` is cleared while an update holds new requests back; an update in
    ``abort`` mode bumps ``abort_epoch``, so the samples it aborted go on."""

    def __init__(
        self, fleet: Fleet, bound: Staleness, changes: Changes, engine_timeout: float
    ) -> None:
        self._fleet = fleet
        self._bound = bound
        self._changes = changes
        self.engine_timeout = engine_timeout
        self.ready: deque[Unit] = deque()
        self.running = asyncio.Event()  # set while no update holds rollouts back
        self.running.set()
        self.abort_epoch = 0  # bumped by an update in abort mode: its aborts are continued
        self.tasks: set[asyncio.Task[Any]] = set()
        self.failed_groups = 0

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` as a task that :meth:`cancel` ends."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def cancel(self) -> None:
        """Cancel every sample in flight (their groups are cancelled)."""
        for task in list(self.tasks):
            task.cancel()

    def submit(self, group: Any, prompt_ids: list[int], params: SamplingParams, n: int) -> Unit:
        """Admit and start the ``n`` samples of ``prompt_ids``; their unit."""
        loop = asyncio.get_running_loop()
        unit = Unit(next(_ids), group, prompt_ids, params, n, loop.create_future())
        self._start(unit)
        return unit

    def _start(self, unit: Unit) -> None:
        self._bound.admit(unit.n)
        unit.completions = [None] * unit.n
        unit.ended = 0
        for i in range(unit.n):
            self.spawn(self._rollout(unit, i))
        self._changes.notify()

    async def _rollout(self, unit: Unit, i: int) -> None:
        """One sample: generated on an engine; continued on another after an abort of an
        update in ``abort`` mode, after its engine failed (from the tokens it had before
        it went there) or left the fleet (``remove_engine``'s ``requests``)."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason: FinishReason = "length"
        engine_name = ""
        try:
            while len(tokens) < unit.params.max_tokens:
                await self.running.wait()
                epoch = self.abort_epoch
                member = await self._changes.until(
                    self._fleet.pick, self.engine_timeout, "an engine that serves"
                )
                done = await self._generate(member, unit, i, tokens)
                if done is None or (done.finish_reason == "abort" and member.removed):
                    if member.removed == "restart":
                        tokens, logprobs, versions = [], [], []
                    if done is None or member.removed == "restart":
                        continue  # its tokens there are lost: on from before it went there
                tokens += done.token_ids
                logprobs += done.logprobs
                versions += done.versions
                reason, engine_name = done.finish_reason, done.engine or member.name
                if reason != "abort" or (self.abort_epoch == epoch and not member.removed):
                    break  # an abort by an update in abort mode or a removal goes on
        except asyncio.CancelledError:
            self._ended(unit, None, None)
            raise
        except Exception as e:  # the request's fault, or no engine served: the group's error
            self._ended(unit, None, e)
            return
        done_ = Completion(
            request_id=f"r{unit.id}-{i}", prompt_ids=unit.prompt_ids, token_ids=tokens,
            logprobs=logprobs, versions=versions, finish_reason=reason, engine=engine_name,
        )  # fmt: skip
        unit.completions[i] = done_
        self._ended(unit, done_, None)

    async def _generate(
        self, member: Member, unit: Unit, i: int, tokens: list[int]
    ) -> Completion | None:
        """One request of a sample on ``member``; None if the engine failed it or left."""
        params = msgspec.structs.replace(
            unit.params, max_tokens=unit.params.max_tokens - len(tokens)
        )
        request = GenerateRequest(
            request_id=f"r{unit.id}-{i}-{len(tokens)}", prompt_ids=unit.prompt_ids + tokens,
            params=params,
        )  # fmt: skip
        task = asyncio.current_task()
        assert task is not None  # a sample is a task (spawn)
        call = Call(task, asyncio.get_running_loop().create_future())
        member.calls[request.request_id] = call
        member.running += 1
        try:
            return await member.engine.generate(request)
        except asyncio.CancelledError:
            if self._changes.closed or not call.taken:
                raise
            if sys.version_info >= (3, 11):
                task.uncancel()  # remove_engine took it back: the sample goes on
            return None
        except (EngineError, SecurityError) as e:  # the engine's: out of rotation, on elsewhere
            why = e.reason if isinstance(e, EngineError) else str(e)
            self._fleet.mark(member, "broken", f"a request failed: {why}")
            self._changes.notify()
            return None
        finally:
            member.running -= 1
            member.calls.pop(request.request_id, None)
            call.returned.set_result(None)

    def _ended(self, unit: Unit, done: Completion | None, error: BaseException | None) -> None:
        """A sample of ``unit`` finished, failed (``error``) or was cancelled (neither);
        the group resolves once all ended. A group's error is logged once and reaches
        whoever awaits its future (and nobody else)."""
        unit.ended += 1
        self._bound.finish(accepted=done is not None)
        if done is None and not unit.future.done():
            if error is None:
                unit.future.cancel()  # closed: nobody needs to hear of it
            else:
                self.failed_groups += 1
                log.warning("group %r failed: %s", unit.group, error)
                unit.future.set_exception(error)
                unit.future.exception()  # logged above: asyncio need not log it again
        if unit.ended == unit.n:
            if unit.future.done():  # it failed: its finished samples will not be trained
                self._bound.discard(sum(c is not None for c in unit.completions))
            else:
                finished = [c for c in unit.completions if c is not None]
                group = Group(group=unit.group, prompt_ids=unit.prompt_ids, completions=finished)
                unit.version_start = group.version_start  # read at every take: once here
                self.ready.append(unit)
                unit.future.set_result(group)
        # what a waiter checks (a ready unit, the bound's room) changes only here: a sample
        # that finished whole while others of its unit run changes neither (with no
        # max_running, it moves from running to accepted)
        if unit.ended == unit.n or done is None or self._bound.max_running is not None:
            self._changes.notify()

    def take(self, groups: int, regenerate: bool, trainer: int | None = None) -> list[Unit] | None:
        """The ``groups`` oldest ready units that are fresh enough for the weights of version
        ``trainer`` (None: the version now), once there are as many (None before); the ready
        units that lag too much for it are dropped or started again (``regenerate``) first."""
        keep: deque[Unit] = deque()
        stale = 0
        while self.ready:
            unit = self.ready.popleft()
            if not self._bound.stale(unit.version_start, trainer):
                keep.append(unit)
                continue
            stale += 1
            self._bound.discard(unit.n)
            if regenerate:
                self._bound.regenerated += unit.n
                again = Unit(
                    unit.id, unit.group, unit.prompt_ids, unit.params, unit.n,
                    asyncio.get_running_loop().create_future(),
                )  # fmt: skip
                self._start(again)
        self.ready = keep
        if stale and not regenerate:  # room for what was dropped: a submit may go on
            self._changes.notify()
        if len(self.ready) < groups:
            return None
        return [self.ready.popleft() for _ in range(groups)]
