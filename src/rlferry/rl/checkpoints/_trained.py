"""``trained.jsonl``: the audit trail of a run's trained samples.

One line per trained step, ``{"step": S, "version": V, "uids": [...]}`` (``V``: the
model version the step made; a uid names one trained sample within the job), flushed as
the step ends. A resumed run cuts it back to its checkpoint's step and continues it: the
file alone tells whether every sample was trained exactly once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["TrainedLog"]


class TrainedLog:
    """``trained.jsonl``: a line per trained step, flushed as it is written. ``after``: the
    step of the checkpoint a run resumes from (the file is cut back to it: the lines past
    it belong to no model any more, a last line cut short by a kill included); None: a
    new run (the file starts empty)."""

    def __init__(self, path: str | os.PathLike[str], after: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if after is not None and self.path.exists():
            for line in self.path.read_text().splitlines(keepends=True):
                if not line.endswith("\n"):
                    break  # cut short: its step never ended
                if json.loads(line)["step"] <= after:
                    kept.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")  # noqa: SIM115 (open for the run, closed by close)

    def append(self, step: int, version: int, uids: list[str]) -> None:
        self._file.write(json.dumps({"step": step, "version": version, "uids": uids}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
