"""What a demo run records: one row per training step, and the run's summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunRecord", "StepRecord"]


@dataclass
class StepRecord:
    """One training step of a run. Seconds are wall-clock seconds of the driver.

    ``generate_seconds``: the engines' busy time during the step (summed over engines,
    divided by their number); ``wait_seconds``: the trainer waiting for rollouts (the
    batch not ready yet); ``train_seconds``: the trainer's forward, backward and
    optimizer step (the slower DP rank); ``sync_seconds``: what the step waited for weight
    updates: its own (pause, push, commit, resume), or, in an asynchronous run, the update
    of the step before, pushing while the ranks got their batch, as far as their step
    waited for it (the ranks' ``held_seconds``); ``dispatch_seconds``: the driver
    starting the requests the update let go (new rollouts wait while an update runs),
    before its next train command. Parts of those: ``put_seconds``, the driver scoring
    the batch and putting it into the queue, as far as the step waited for it (between
    waiting and training: a batch taken ahead, while the step before trained, costs
    none); ``get_seconds`` and ``optimize_seconds``, within training, the slower rank's
    get of its share from the queue and its optimizer step (forward, backward, update).
    ``lags``: every trained sample's lag, in versions.
    """

    step: int
    wall: float  # seconds since the run started, at the end of this step
    reward_mean: float
    reward_max: float
    samples: int
    samples_per_s: float
    staleness_mean: float
    staleness_max: int
    generate_seconds: float
    wait_seconds: float
    train_seconds: float
    sync_seconds: float
    loss: float
    lags: list[int] = field(default_factory=list)
    version: int = 0
    dispatch_seconds: float = 0.0
    put_seconds: float = 0.0
    get_seconds: float = 0.0
    optimize_seconds: float = 0.0


@dataclass
class RunRecord:
    """A whole run: its name (``"async (max_staleness=2)"``), its settings, its steps, and
    figures measured once (``summary``: e.g. ``reward_start``, ``reward_end``,
    ``wall_seconds``, ``samples_per_s``, ``sync_share``)."""

    name: str
    config: dict[str, Any]
    steps: list[StepRecord] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
