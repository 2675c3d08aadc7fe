"""The demo's job checkpoints (:mod:`._job`), a trainer rank's part of them (:mod:`._rank`),
the audit trail of trained samples (:mod:`._trained`) and the points where recovery tests
kill the driver (:mod:`._faults`)."""

from ._faults import KILL_ENV, kill_point
from ._job import (
    CHECKPOINT_KEEP,
    RESUMABLE,
    Checkpoints,
    check_resumable,
    job_state,
    save_job,
)
from ._rank import load_rank, save_rank
from ._trained import TrainedLog

__all__ = [
    "CHECKPOINT_KEEP", "KILL_ENV", "RESUMABLE", "Checkpoints", "TrainedLog", "check_resumable",
    "job_state", "kill_point", "load_rank", "save_job", "save_rank",
]  # fmt: skip
