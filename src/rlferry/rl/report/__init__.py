"""The demo's report: what a run records (:mod:`._records`), the markdown and the data
(:mod:`._markdown`), the plots (:mod:`._plots`)."""

from ._markdown import format_progress, read_runs, summarize, write_report
from ._records import RunRecord, StepRecord

__all__ = ["RunRecord", "StepRecord", "format_progress", "read_runs", "summarize", "write_report"]
