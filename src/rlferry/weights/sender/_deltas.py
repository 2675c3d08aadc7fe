"""A sender's pushes when it keeps a base (``delta_budget``): each one a delta or full.

A push is a delta only if the base holds a version of the pushed names, shapes and
dtypes, every receiver of the group takes deltas and said it holds that version whole,
and the measured policy (``delta._policy``) finds deltas faster; its tensors are
encoded against the base and pushed through the :class:`~._pusher.Pusher` as any
tensors are, the header riding in every member's Setup. The members are checked again
on the wire loop once the push picked them: one that joined meanwhile makes the push
full (it is made again, nothing having moved). Any other push is full: the first, one
with ``full=True``, one to a receiver that lacks the base (new, rejoined, restored, or
one that failed or loaded part of a push since).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from .._report import PushReport
from ..delta._base import KeptBase
from ..delta._encoding import Encoded, unchanged
from ..delta._header import DeltaHeader
from ..delta._policy import DELTA, FULL, Policy
from ..protocol._members import Member
from ._course import MembersChanged
from ._pusher import Pusher
from ._turns import drain

__all__ = ["DeltaPushes"]

Pairs = list[tuple[str, torch.Tensor]]


def _hold(members: list[Member], version: int | None) -> bool:
    """Whether every one of ``members`` (one at least) takes deltas and holds ``version``."""
    return bool(members) and all(m.deltas and m.holds == version for m in members)


class DeltaPushes:
    """The pushes of a sender that keeps ``budget`` bytes of its last version (``where``:
    ``"device"`` or ``"host"``), over ``pusher``; ``always``: a delta whenever a push may
    be one (else as the measured policy finds faster)."""

    def __init__(self, pusher: Pusher, budget: int, where: str, always: bool = False) -> None:
        self.pusher = pusher
        self.base = KeptBase(budget, where)
        self.policy = Policy(always)
        self.pushes = 0  # delta pushes
        self._first = True

    def push(self, pairs: Pairs, version: int, timeout: float, full: bool) -> PushReport:
        first, self._first = self._first, False
        kind, keep = FULL, True
        if not (full or first):
            kind = self.policy.choose()
            base = self.base
            if kind == DELTA:
                takes, holds = self._members(base.version, timeout)
                if not (holds and base.matches(pairs)):
                    # it cannot be one: the base is kept now for the next push, unless a
                    # receiver that never takes deltas makes every push full
                    kind, keep = FULL, takes
            else:
                keep = self.policy.keep_base()
        if kind == DELTA:
            report = self._delta(pairs, version, timeout)
            if report is not None:
                return report
        if keep:
            t0 = time.perf_counter()
            self.base.refresh(pairs, version)
            self.policy.refreshed(time.perf_counter() - t0)
        else:
            self.base.drop()
        t0 = time.perf_counter()
        report = drain(self.pusher.steps(pairs, version, timeout))
        if not first:
            self.policy.timed(FULL, time.perf_counter() - t0)
        return report

    def _members(self, version: int | None, timeout: float) -> tuple[bool, bool]:
        """Whether every receiver takes deltas, and whether every one holds ``version``, once
        those whose word on the last push is on its way said it (as the push itself waits
        for them, ``JOIN_GRACE`` at most)."""
        hub = self.pusher.parts.hub
        deadline = time.monotonic() + timeout

        async def check() -> tuple[bool, bool]:
            await hub.until(lambda: not any(m.returning for m in hub.members.values()), deadline)
            ms = [m for m in hub.members.values() if not m.gone]
            return bool(ms) and all(m.deltas for m in ms), _hold(ms, version)

        return self.pusher.parts.loop.run(check())

    def _delta(self, pairs: Pairs, version: int, timeout: float) -> PushReport | None:
        """The delta push of ``pairs``; None if its members changed (it is made full)."""
        t0 = time.perf_counter()
        base = self.base.version
        assert base is not None
        enc = self.base.encode(pairs, version)
        if not enc.pushed:  # nothing changed: one tensor goes, saying so
            kept = zip(pairs, self.base.kept, strict=True)
            unchanged(*next(pair for pair, k in kept if k is not None), enc)
        header = DeltaHeader(base, tuple(enc.sparse)).to_wire()
        steps = self.pusher.steps(
            enc.pushed, version, timeout, delta=header, accept=lambda ms: _hold(ms, base)
        )
        try:
            report = drain(steps)
        except MembersChanged:
            return None
        self.policy.timed(DELTA, time.perf_counter() - t0)
        self.pushes += 1
        return _delta_report(report, enc, pairs)

    def statistics(self) -> dict[str, Any]:
        """The delta fields of the sender's statistics."""
        return {"delta_bytes": self.base.nbytes, "delta_pushes": self.pushes}


def _delta_report(report: PushReport, enc: Encoded, pairs: Pairs) -> PushReport:
    full = sum(t.numel() * t.element_size() for _, t in pairs)
    changed = enc.changed / enc.compared if enc.compared else 0.0
    return dataclasses.replace(
        report, kind="delta", sent_bytes=report.bytes, full_bytes=full, changed=changed
    )
