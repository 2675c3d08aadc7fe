"""The weight plane's errors: one base class, and one subclass per end of life.

``WeightSyncError`` is the base of them all (catch it to catch any). A push
that some receivers failed raises it with ``failures`` (each failed receiver's
name and reason) and ``report`` (who committed). The subclasses say how a
sender or a receiver ended, as the wire's ``ChannelClosed``, ``PeerGone`` and
``RequestTimeout`` do for a channel:

- :class:`SenderClosed`: you closed the sender, then pushed.
- :class:`ReceiverClosed`: you closed the receiver, then waited on it or started it.
- :class:`SenderGone`: the receiver's sender closed, died, or never answered.
- :class:`PushTimeout` (also a ``TimeoutError``): a push did not finish in its timeout.

:class:`BlockFP8Error` (also a ``RequestError``) is a layout or a push that block FP8
cannot serve, named before any byte moves.
:class:`DeltaBaseMissing` (also a ``RequestError``) is a delta push that a receiver refused
before any byte moved: it does not hold the version the delta was made against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from rlferry.errors import Closed, Gone, RequestError, RlferryError, Timeout

if TYPE_CHECKING:
    from ._report import PushReport

__all__ = [
    "BlockFP8Error",
    "DeltaBaseMissing",
    "PushTimeout",
    "ReceiverClosed",
    "SenderClosed",
    "SenderGone",
    "WeightSyncError",
]


class WeightSyncError(RlferryError):
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


class SenderClosed(WeightSyncError, Closed):
    """The sender was closed (by you): it pushes no more. Make a new one."""


class ReceiverClosed(WeightSyncError, Closed):
    """The receiver was closed (by you): it loads no more, ``wait_for`` cannot succeed
    for a version it does not hold, and it cannot start again. Make a new one."""


class SenderGone(WeightSyncError, Gone):
    """The receiver's sender went away (closed or died), or never answered its join:
    the receiver loads no more and keeps its last version. Join the next sender with
    a new receiver."""


class PushTimeout(WeightSyncError, Timeout):
    """A push did not finish within its ``timeout``: too few receivers were ready
    (the message names each that joined and what it was doing), or some did not
    acknowledge in time (``failures`` names them; ``report`` says who committed)."""


class BlockFP8Error(WeightSyncError, RequestError):
    """Block FP8 that cannot be served, named before any byte moves: a block-FP8 parameter
    whose parts are not whole 128 x 128 blocks, a block that straddles two trainer ranks'
    shards (one rank cannot scale it alone), or a push of a tensor in block FP8 to an
    engine that does not keep it so (the engine keeps serving its version)."""


class DeltaBaseMissing(WeightSyncError, RequestError):
    """A delta push reached a receiver that does not hold its base version (its version
    was changed behind the sender's back, or it loaded part of a push since): the
    receiver refused it at its Setup, before any byte moved, and keeps serving its
    version. ``failures`` names it with the base asked and the version it holds; its next
    push is full."""
