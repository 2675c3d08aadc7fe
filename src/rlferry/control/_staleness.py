"""How many samples may be generated ahead of the trainer, and how stale a trained one may be.

The bound is AReaL's: with trainer version ``v``, at most ``(eta + v + 1) * batch_size``
samples may have been accepted or be running, ``eta`` being ``max_staleness``. A
sample's lag is ``v - version_start`` at the moment the trainer takes it; admission
keeps most samples within ``eta``, and the check at consume time catches the rest (a
long request admitted early, finished late). The counters are what a restart must
restore (``state_dict``): without them the bound resets to ``(eta + v + 1) *
batch_size`` free slots at once, and staleness is unbounded (AReaL #1388).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlferry.errors import RequestError

__all__ = ["Staleness"]


@dataclass
class Staleness:
    """The counters of the bound; every method runs on the coordinator's loop."""

    batch_size: int
    max_staleness: int
    max_running: int | None = None
    version: int = 0
    accepted: int = 0  # samples finished and not dropped (in the buffer or consumed)
    running: int = 0  # samples admitted and not finished
    consumed: int = 0
    dropped: int = 0
    regenerated: int = 0
    lag_sum: int = 0
    lag_max: int = 0

    def __post_init__(self) -> None:
        if type(self.batch_size) is not int or self.batch_size < 1:
            raise RequestError(f"batch_size: expected an int >= 1, got {self.batch_size!r}")
        if type(self.max_staleness) is not int or self.max_staleness < 0:
            raise RequestError(
                f"max_staleness: expected an int >= 0 (0 = synchronous), got {self.max_staleness!r}"
            )
        if self.max_running is not None and (
            type(self.max_running) is not int or self.max_running < 1
        ):
            raise RequestError(
                f"max_running: expected None or an int >= 1, got {self.max_running!r}"
            )

    def capacity(self) -> int:
        """Samples that may be admitted now."""
        room = (self.max_staleness + self.version + 1) * self.batch_size - (
            self.accepted + self.running
        )
        if self.max_running is not None:
            room = min(room, self.max_running - self.running)
        return room

    def admit(self, n: int) -> None:
        self.running += n

    def finish(self, accepted: bool) -> None:
        """An admitted sample finished (``accepted``) or failed."""
        self.running -= 1
        if accepted:
            self.accepted += 1
        else:
            self.dropped += 1

    def lag(self, version_start: int, trainer: int | None = None) -> int:
        """How many versions the weights that train a sample (``trainer``; None: the
        version now) are past those that started it."""
        return (self.version if trainer is None else trainer) - version_start

    def stale(self, version_start: int, trainer: int | None = None) -> bool:
        return self.lag(version_start, trainer) > self.max_staleness

    def consume(self, n: int, lag: int) -> None:
        self.consumed += n
        self.lag_sum += lag * n
        self.lag_max = max(self.lag_max, lag)

    def discard(self, n: int) -> None:
        """Accepted samples that will not be trained (stale at consume time, or of a group
        that failed): they leave the bound's count."""
        self.accepted -= n
        self.dropped += n

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "consumed": self.consumed,
            "dropped": self.dropped,
            "regenerated": self.regenerated,
            "lag_sum": self.lag_sum,
            "lag_max": self.lag_max,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after a restart: what was generated but not consumed is gone, so the
        bound counts the consumed samples as accepted (the trainer's progress)."""
        for key in ("version", "consumed", "dropped", "regenerated", "lag_sum", "lag_max"):
            value = state.get(key)
            if type(value) is not int or value < 0:
                raise RequestError(
                    f"state_dict[{key!r}]: expected an int >= 0, got {value!r} "
                    "(pass what Coordinator.state_dict() returned)"
                )
            setattr(self, key, value)
        self.accepted = self.consumed
        self.running = 0
