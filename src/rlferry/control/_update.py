"""One weight update: pause -> start -> push -> finish -> resume, and whose fault a failure is.

The rules (the README's control section states them for users):

- Every engine that served before the update serves after it, on its last whole
  version, unless it is itself at fault. The engines that committed the new version
  serve it; the others end the update on the version they hold (``finish_weight_update``
  of their own version). No engine is told to finish a version it did not receive.
- The parties at fault, and only they, are named in the ``WeightUpdateError``: an
  engine that failed a step, an engine that did not receive a push that went through,
  or ``push`` for the trainer's push itself (its source raised, a shape did not match,
  it timed out). An engine that failed a step gets no rollouts until an update reaches
  it; an engine that is gone (``EngineError.gone``) is broken until it is added again.
- A push that failed after an engine loaded part of it leaves that engine holding a
  mix: it is not at fault, but it serves nothing until the next update reaches it
  (``WeightUpdateError.waiting`` names it). Engines load buckets in place: no second
  copy of the weights is kept to roll back to.
- The trainer's version becomes the new one if any engine committed it; otherwise it
  stays, so the caller can retry the same version.
- In ``keep`` mode an engine that loads between its own steps
  (``EngineStatistics.loads_between_steps``) is neither paused nor resumed: the push stops
  its steps for as long as it loads, and one that committed serves the new version from
  its next step, so it is not asked to finish either. Only an engine the push did not
  reach whole is asked for its version and told to finish on it, as above.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from rlferry.wire import SecurityError

from ._engine import PauseMode
from ._errors import EngineError, WeightUpdateError
from ._fleet import Fleet, Member

__all__ = ["PUSH", "UpdateReport", "run_update"]

PUSH = "push"
"""The party of a failure of the trainer's push itself (no engine's fault)."""
RESUME_BOUND = 10.0
"""Seconds every engine has to resume, even after the update's own deadline passed."""


class UpdateReport(msgspec.Struct, frozen=True, kw_only=True):
    """One weight update: its version and how long each phase took."""

    version: int
    engines: tuple[str, ...]
    pause_seconds: float
    push_seconds: float
    finish_seconds: float
    resume_seconds: float
    seconds: float


class _Faults:
    """Who failed which stage, the first stage that failed, and who is gone."""

    def __init__(self) -> None:
        self.failures: dict[str, tuple[str, str]] = {}  # party: (stage, why)
        self.stage: str | None = None
        self.gone: set[str] = set()

    def add(self, party: str, stage: str, why: str, *, gone: bool = False) -> None:
        if party in self.failures:
            return
        self.failures[party] = (stage, why)
        self.stage = self.stage or stage
        if gone:
            self.gone.add(party)

    def text(self) -> dict[str, str]:
        return {party: f"{stage}: {why}" for party, (stage, why) in self.failures.items()}

    def ok(self, members: list[Member]) -> list[Member]:
        return [m for m in members if m.name not in self.failures]


async def _each(
    members: list[Member],
    call: Callable[[Member], Awaitable[Any]],
    stage: str,
    deadline: float,
    faults: _Faults,
) -> dict[str, Any]:
    """``call`` every member at once until ``deadline``; what each answered, by name. A
    member that fails or is late is recorded in ``faults`` under ``stage``."""
    out: dict[str, Any] = {}

    async def one(m: Member) -> None:
        try:
            out[m.name] = await asyncio.wait_for(call(m), max(0.001, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            faults.add(m.name, stage, "did not finish in time", gone=True)
        except EngineError as e:
            faults.add(m.name, stage, e.reason, gone=e.gone)
        except SecurityError as e:
            faults.add(m.name, stage, str(e), gone=True)
        except Exception as e:
            faults.add(m.name, stage, f"{type(e).__name__}: {e}")

    await asyncio.gather(*(one(m) for m in members))
    return out


async def run_update(
    fleet: Fleet,
    push: Callable[[float], Any],
    *,
    version: int,
    current: int,
    max_staleness: int,
    mode: PauseMode,
    timeout: float,
) -> tuple[int, UpdateReport | WeightUpdateError]:
    """Run one update of the fleet's serving and behind members from ``current`` to
    ``version``; the trainer's version after it, and its report or error."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    members = [m for m in fleet if m.state in ("serving", "behind")]
    # engines a push stops by itself: nothing to pause, start, finish (once committed), resume
    gated = {m.name for m in members if mode == "keep" and m.loads_between_steps}
    stopped = [m for m in members if m.name not in gated]
    faults = _Faults()
    waiting: dict[str, str] = {}
    committed: list[Member] = []
    marks = [t0]
    try:
        await _each(stopped, lambda m: m.engine.pause(mode), "pause", deadline, faults)
        await _each(
            faults.ok(stopped), lambda m: m.engine.start_weight_update(), "start_weight_update",
            deadline, faults,
        )  # fmt: skip
        marks.append(time.monotonic())
        ready = faults.ok(members)
        if ready:
            report, raised = await _push(push, ready, deadline, timeout, faults)
        else:  # every engine failed before it: no receiver would join, so no push waits
            report, raised = None, True
        marks.append(time.monotonic())
        live = faults.ok(members)
        # Who committed: the push's report says (``PushReport.receivers``, own names), also
        # when it raised; without a report, a push that returned reached every engine.
        said = getattr(report, "receivers", None)
        got = {m.name for m in live if (_among(m.own, said) if said is not None else not raised)}
        rest = [m for m in live if m.name not in got]
        held = await _each(
            rest, lambda m: m.engine.get_weight_version(), "finish_weight_update", deadline,
            faults,
        )  # fmt: skip
        if not raised:
            for m in rest:
                faults.add(
                    m.name, "push", f"did not receive version {version} (it holds "
                    f"{held.get(m.name)}; is its receiver joined to the trainer's sender? see "
                    "init_weight_transfer)",
                )  # fmt: skip
        live = [m for m in live if m.name in got or m.name in held]
        # Each ends the update on what it holds: the new version, or its last whole one.
        target = {
            m.name: version if m.name in got else current if held[m.name] is None
            else held[m.name] for m in live
        }  # fmt: skip
        ending = _Faults()
        told = [m for m in live if m.name not in gated or m.name not in got]
        await _each(
            told, lambda m: m.engine.finish_weight_update(target[m.name]),
            "finish_weight_update", deadline, ending,
        )  # fmt: skip
        for m in live:
            failed = ending.failures.get(m.name)
            if failed is None:
                m.version = target[m.name]
                if m.version == version:
                    committed.append(m)
            elif not raised or m.name in got or m.name in ending.gone:
                faults.add(m.name, *failed, gone=m.name in ending.gone)
            else:  # the push failed after it loaded part of it: not its fault
                waiting[m.name] = f"it holds a mix after the failed push ({failed[1]})"
        marks.append(time.monotonic())
    finally:
        end_by = max(deadline, time.monotonic() + RESUME_BOUND)
        alive = [m for m in stopped if m.name not in faults.gone]
        await _each(alive, lambda m: m.engine.resume(), "resume", end_by, faults)
        after = version if committed else current
        text = faults.text()
        for m in members:
            why = text.get(m.name)
            if m.name in faults.gone:
                fleet.mark(m, "broken", why)
            elif why is not None:
                fleet.mark(m, "behind", f"failed the update to version {version}: {why}")
            elif m.name in waiting:
                fleet.mark(m, "behind", waiting[m.name])
            else:
                fleet.place(m, after, max_staleness)
    end = time.monotonic()
    marks += [end] * (5 - len(marks))
    if faults.failures or waiting:
        serving = {m.name: m.version for m in members if m.state == "serving"}
        stage = faults.stage or "push"
        return after, WeightUpdateError(version, stage, text, serving, waiting, after)
    return after, UpdateReport(
        version=version, engines=tuple(m.name for m in members),
        pause_seconds=marks[1] - t0, push_seconds=marks[2] - marks[1],
        finish_seconds=marks[3] - marks[2], resume_seconds=end - marks[3], seconds=end - t0,
    )  # fmt: skip


def _among(own: str | None, receivers: Any) -> bool:
    """Whether the engine whose receiver is named ``own`` is among ``receivers`` (an engine of
    several workers has one receiver each, ``OWN:rankN``, as rlferry's vLLM backend names
    them)."""
    return own is not None and any(r == own or r.startswith(f"{own}:rank") for r in receivers)


async def _push(
    push: Callable[[float], Any],
    members: list[Member],
    deadline: float,
    timeout: float,
    faults: _Faults,
) -> tuple[Any, bool]:
    """Run the trainer's push: what it returned (or its error's ``report``), and whether it
    raised. A failure is the receivers' it names, else the push's own."""
    left = max(0.001, deadline - time.monotonic())
    try:
        pushing = push(left) if inspect.iscoroutinefunction(push) else asyncio.to_thread(push, left)
        result = await asyncio.wait_for(pushing, left + 1.0)
        if inspect.isawaitable(result):  # a function that returned the push's coroutine
            left = max(0.001, deadline - time.monotonic())
            result = await asyncio.wait_for(result, left + 1.0)
        return result, False
    except asyncio.TimeoutError:
        faults.add(PUSH, "push", f"did not return within {timeout} s")
        return None, True
    except Exception as e:
        named: dict[str, str] = getattr(e, "failures", None) or {}
        owns = {m.own for m in members}
        if named and owns <= set(named) and len(set(named.values())) == 1:
            # every engine refused it for the same reason: the push's layout is wrong
            faults.add(PUSH, "push", f"every engine refused it: {next(iter(named.values()))}")
            return None, True
        by_own = {m.own: m.name for m in members if m.own is not None}
        for own, why in named.items():
            faults.add(by_own.get(own, own), "push", why)
        if not named:
            faults.add(PUSH, "push", f"{type(e).__name__}: {e}")
        return getattr(e, "report", None), True
