"""The demo's job checkpoints and its audit trail of trained samples.

A checkpoint is taken at a step boundary (after the step's weight update) into a
directory of its own, ``step-SSSSSSSS`` under the checkpoint directory: the driver's
state (``job.rlf``: the step, the coordinator's versions and staleness counters, the
prompts drawn and not yet trained, the producer's RNG, the run's record so far), one file
per trainer rank (its parameters' shards, its optimizer's state, its RNG) and the queue
(``queue/``, :meth:`rlferry.queue.Queue.save`). It is written under a temporary name and
renamed into place once whole: a directory named ``step-*`` is always whole. The last
``keep`` are kept. Beside them, ``base/`` holds the warm-started model the engines and
the trainers load before a checkpoint's weights (written once, by ``save_pretrained``).

Every file is read without running code (no pickle, no ``torch.save``): tensors and
values as the wire encodes them, in :func:`rlferry.wire.files.write_file`'s checked
format.

"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from rlferry.errors import RequestError
from rlferry.wire.files import fsync_directory, read_file, write_file

from .._processes import call
from ._faults import kill_point

__all__ = [
    "CHECKPOINT_KEEP", "JOB_FILE", "RESUMABLE", "Checkpoints",
    "check_resumable", "job_state", "save_job",
]  # fmt: skip

CHECKPOINT_KEEP = 2  # whole checkpoints kept; older ones are removed once a new one is whole
JOB_FILE = "job.rlf"
_STEP = re.compile(r"step-(\d{8})")


class Checkpoints:
    """The checkpoints of a job in ``root``: the whole ones, by step."""

    def __init__(self, root: str | os.PathLike[str], keep: int = CHECKPOINT_KEEP) -> None:
        if type(keep) is not int or keep < 1:
            raise RequestError(f"checkpoint_keep: expected an int >= 1, got {keep!r}")
        self.root = Path(root)
        self.keep = keep

    @property
    def base(self) -> Path:
        """The warm-started model (``save_pretrained``): what every process loads first."""
        return self.root / "base"

    def check_new(self) -> None:
        """A new job's checkpoints go into a directory that holds none of another job."""
        if self.whole() or self.base.exists():
            raise RequestError(
                f"checkpoint_dir: expected a directory without checkpoints for a new run, got "
                f"{str(self.root)!r} holding another run's (continue it with --resume "
                f"{self.root}, or remove it, or give another --checkpoint-dir)"
            )

    def whole(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every whole checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP.fullmatch(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> tuple[int, Path]:
        """The last whole checkpoint; ``RequestError`` naming the directory if none."""
        found = self.whole()
        if not found or not self.base.is_dir():
            what = "no base/ directory" if not self.base.is_dir() else "no whole step-* checkpoint"
            raise RequestError(
                f"resume: expected a checkpoint directory written by `rlferry demo "
                f"--checkpoint-every N`, got {str(self.root)!r} with {what} (name the "
                f"directory that holds base/ and step-*; by default OUT/checkpoints)"
            )
        return found[-1]

    def begin(self, step: int) -> Path:
        """A new, empty directory to write step ``step``'s checkpoint into."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".step-{step:08d}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int) -> Path:
        """Rename ``tmp`` (whole) into place as step ``step``'s checkpoint; remove the
        checkpoints past the last ``keep`` and what unfinished writes left."""
        final = self.root / f"step-{step:08d}"
        fsync_directory(tmp)
        if final.exists():  # a resumed run writes the same step again
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_directory(self.root)
        for _, old in self.whole()[: -self.keep]:
            shutil.rmtree(old)
        for p in self.root.glob(".step-*.tmp-*"):
            if p != tmp:
                shutil.rmtree(p, ignore_errors=True)
        return final


def job_state(path: Path) -> dict[str, Any]:
    """The driver's state in checkpoint ``path``."""
    state = read_file(path / JOB_FILE)
    if not isinstance(state, dict) or "step" not in state:
        raise RequestError(f"{path / JOB_FILE}: expected the demo's job state, got {type(state)}")
    return state


# Settings a resumed run must share with the checkpointed one (the rest may change).
RESUMABLE = ("model", "lora", "seed", "device", "layout", "engine", "group_size",
             "groups_per_step", "max_staleness", "sync")  # fmt: skip


def check_resumable(config: Any, saved: dict[str, Any], at: Path) -> None:
    """Refuse to resume checkpoint ``at`` under settings it was not written with."""
    for name in RESUMABLE:
        if saved.get(name) != getattr(config, name):
            raise RequestError(
                f"resume: {name}: expected {saved.get(name)!r} (as the run that wrote {at} "
                f"had), got {getattr(config, name)!r} (resume with the same "
                f"--{name.replace('_', '-')})"
            )


async def save_job(
    ckpts: Checkpoints, step: int, ranks: list[Any], queue: Any, job: dict[str, Any]
) -> tuple[float, int]:
    """Write step ``step``'s checkpoint: every trainer rank's part, the queue (``queue``:
    a :class:`rlferry.queue.Queue`, or None where the queue is not this process's to
    save), then the driver's state ``job``; renamed into place once whole. Returns its
    seconds and bytes."""
    t0 = time.monotonic()
    tmp = ckpts.begin(step)
    await asyncio.gather(*(
        asyncio.to_thread(call, conn, "save", str(tmp)) for conn in ranks
    ))  # fmt: skip
    if queue is not None:
        await asyncio.to_thread(queue.save, tmp / "queue")
    kill_point("checkpoint", step)
    write_file(tmp / JOB_FILE, job)
    nbytes = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    ckpts.commit(tmp, step)
    return time.monotonic() - t0, nbytes
