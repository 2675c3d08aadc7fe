"""Points where a test of the demo's recovery kills its driver.

``RLFERRY_DEMO_KILL=POINT:STEP`` in the driver's environment sends SIGKILL to the
driver's whole process group (its engines and trainers die with it, as under ``kill -9``
of the group) when the run reaches ``POINT`` at step ``STEP``: ``put`` (while the step's
batch goes into the queue), ``train`` (while the trainer ranks train), ``push`` (while
they push the update), ``checkpoint`` (the trainer ranks' files written, the driver's
not), ``step`` (after a step ended, its checkpoint included), ``resumed`` (while the
first step after a resume trains). Unset: nothing happens.
"""

from __future__ import annotations

import os
import signal

__all__ = ["KILL_ENV", "kill_point"]

KILL_ENV = "RLFERRY_DEMO_KILL"


def kill_point(point: str, step: int) -> None:
    """Kill the driver's process group here if the environment asks for this point."""
    if os.environ.get(KILL_ENV) == f"{point}:{step}":
        os.killpg(os.getpgrp(), signal.SIGKILL)
