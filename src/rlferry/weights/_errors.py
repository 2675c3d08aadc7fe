"""The weight plane's error: one class, carrying which receivers failed and why."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._report import PushReport

__all__ = ["WeightSyncError"]


class WeightSyncError(Exception):
    """A push that did not reach every receiver, or a configuration that cannot work.

    ``failures`` maps each failed receiver's name to its reason (empty for a
    configuration error or a failure on the sender's side); ``report`` is the
    push's report when some receivers did commit (their names are in
    ``report.receivers``), else None.
    """

    def __init__(
        self,
        message: str,
        failures: Mapping[str, str] | None = None,
        report: PushReport | None = None,
    ) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        self.report = report
