"""Traces of a trainer rank's steps and pushes, for finding where a step's time goes.

``RLFERRY_DEMO_PROFILE=DIR`` in the demo's environment makes each trainer rank trace
its training steps and its pushes :data:`STEPS` with ``torch.profiler`` (CPU and, on a
GPU, CUDA activity) and write, per phase, the table of its operators sorted by their
own time (``DIR/rank-R-train.txt``, ``DIR/rank-R-push.txt``) and the last step's trace
(``DIR/rank-R-train.json``, ``...-push.json``, for ``chrome://tracing`` or Perfetto).
Unset: nothing is traced.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["PROFILE_ENV", "STEPS", "traced"]

PROFILE_ENV = "RLFERRY_DEMO_PROFILE"
STEPS = range(4, 7)  # after the first steps' one-off costs (allocations, compiles)


@contextlib.contextmanager
def traced(rank: int, phase: str, step: int) -> Iterator[None]:
    """Trace what runs inside, if the environment asks for it at ``step``."""
    where = os.environ.get(PROFILE_ENV)
    if not where or step not in STEPS:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts, record_shapes=False) as prof:
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30)
    with open(out / f"rank-{rank}-{phase}.txt", "a") as f:
        f.write(f"== step {step}\n{table}\n")
    prof.export_chrome_trace(str(out / f"rank-{rank}-{phase}.json"))
