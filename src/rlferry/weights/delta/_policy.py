"""Whether a push that may be a delta is one: from the times the sender measured.

A delta push costs the diff (reading the new tensors and the base) plus the changed
bytes on the link; a full push, every byte on the link. Which is faster depends on the
link (a GPU's own copy outruns the diff; a host's TCP link is outrun by it) and on how
much changed (after a large step most bytes go dense anyway, and the diff is lost time).
So the sender times its pushes, each kind end to end (a delta push with its diff; a full
push without the copy that keeps the base), and pushes the faster kind. A kind's time is
the lower median of its last :data:`KEPT` timed pushes, measured once it has two: single
pushes that pay a one-off cost (an early NCCL broadcast took 199 ms where the others took
13) then never decide, while two slower pushes of the last three do. The slower kind is
tried again (two timed pushes, its older times dropped), to find a change (a learning rate
that decays, a link that slows), once what trying it costs (its extra time, and the copy
of the base a delta's try needs first) is at most :data:`SHARE` of the faster kind's time
over the pushes since: after :data:`FIRST_WAIT` pushes at least, :data:`MOST_WAIT` at
most. When the faster kind slows past the other (more changes: a delta's dense tensors),
its median says so and the kinds swap with no try.

The first push of a kind after a push of the other carries the switch's one-off costs (the
packing buffers made again, handles exported): it is not timed, and the next pushes are of
the same kind, timed. So each kind is measured in its steady state.

While full pushes win, the base is not kept up (its copy would cost a memory pass per
push, a quarter of a full push over gloo on a 2-core host: ``python
benchmarks/weights_delta.py --transport gloo --scale 4``); the push before a try of a
delta refreshes it.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["DELTA", "FIRST_WAIT", "FULL", "KEPT", "MOST_WAIT", "SHARE", "Policy"]

DELTA, FULL = "delta", "full"
SHARE = 0.02
FIRST_WAIT = 8
MOST_WAIT = 1024
KEPT = 3  # timed pushes of each kind whose lower median is its time
MEASURED = 2  # timed pushes a kind needs before its time decides


class Policy:
    """The kind of each push that may be a delta, from measured push times (``always``:
    a delta every time, the base always kept up; for a link known to favour deltas)."""

    def __init__(self, always: bool = False) -> None:
        self.always = always
        self.times: dict[str, deque[float]] = {DELTA: deque(maxlen=KEPT), FULL: deque(maxlen=KEPT)}
        self.refresh = 0.0  # running mean of a copy of the base
        self._since = 0  # pushes of the faster kind since the slower was measured
        self._wait = FIRST_WAIT
        self._last: str | None = None  # the kind of the last push
        self._again: str | None = None  # a kind to push again: not measured yet

    @property
    def seconds(self) -> dict[str, float]:
        """Each measured kind's time: the lower median of its last timed pushes."""
        return {
            k: sorted(t)[(len(t) - 1) // 2] for k, t in self.times.items() if len(t) >= MEASURED
        }

    def best(self) -> str | None:
        """The kind measured faster (None until both were measured)."""
        seconds = self.seconds
        if len(seconds) < 2:
            return None
        return DELTA if seconds[DELTA] < seconds[FULL] else FULL

    def choose(self) -> str:
        """The kind of the next push that may be a delta: each kind is measured (a delta
        first), then the faster, the slower tried when its wait is over."""
        best = self.best()
        if self.always:
            return DELTA
        if self._again is not None:
            return self._again
        if best is None:
            return FULL if len(self.times[DELTA]) >= MEASURED else DELTA
        if self._since >= self._wait:
            return FULL if best == DELTA else DELTA
        return best

    def keep_base(self) -> bool:
        """Whether a full push keeps the base up: the push after it may be a delta."""
        best = self.best()
        if self._again is not None:
            return self.always or self._again == DELTA
        return self.always or best != FULL or self._since + 1 >= self._wait

    def refreshed(self, seconds: float) -> None:
        """A copy of the base took ``seconds``."""
        self.refresh = (
            seconds if not self.refresh else self.refresh + 0.5 * (seconds - self.refresh)
        )

    def timed(self, kind: str, seconds: float) -> None:
        """A push of ``kind`` took ``seconds``."""
        switched = self._last is not None and kind != self._last
        self._last = kind
        times = self.times[kind]
        if switched:  # its time holds the switch's costs: the next pushes are timed instead
            if len(self.times[FULL if kind == DELTA else DELTA]) >= MEASURED:
                times.clear()  # a try: its older times are stale
            self._again = kind
            return
        before = self.best()
        times.append(seconds)
        self._again = kind if len(times) < MEASURED else None
        after = self.best()
        if after is None or self._again is not None:
            return
        if kind == before and kind == after:
            self._since += 1
            return
        # both measured first, the slower kind tried, or the kinds swapped: wait until
        # trying the slower again (its MEASURED pushes) costs at most SHARE of the faster
        # kind's time over the pushes between
        seconds_ = self.seconds
        fast, slow = seconds_[after], seconds_[FULL if after == DELTA else DELTA]
        cost = MEASURED * (slow - fast) + (self.refresh if after == FULL else 0.0)
        self._since = 0
        self._wait = min(MOST_WAIT, max(FIRST_WAIT, math.ceil(cost / (SHARE * fast))))
