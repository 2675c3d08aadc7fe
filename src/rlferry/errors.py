"""The root of every error rlferry raises, and the families that every plane shares.

Each plane has a base class (``WireError``, ``QueueError``, ``WeightSyncError``,
``EngineError``, ...) and each of its classes is also one of the families below,
so code can catch by plane, by family, or both::

    try:
        batch = client.get("train", fields, batch_size=64, timeout=30)
    except rlferry.errors.Timeout:      # GetTimeout, PushTimeout, RequestTimeout, ...
        ...
    except rlferry.errors.Gone:         # a peer, a service, an engine went away
        ...

The families say how something ended, as trio's ``ClosedResourceError`` and
``BrokenResourceError`` do for a stream:

- :class:`Closed`: you (or its owner) closed it, then used it.
- :class:`Gone`: the other side went away: it died, closed, or never answered.
- :class:`Timeout` (also a ``TimeoutError``): a bounded wait ended; the message says
  what was awaited, for how long, and the likely cause.
- :class:`RequestError` (also a ``ValueError``): a value the caller passed is wrong (an
  argument, a field, a request); nothing was stored or sent. The message names the
  field, what was expected, what came, and the fix.
- :class:`SecurityError`: a bind that would expose a service without a secret, or a
  peer that refused this one's secret.
- :class:`RemoteError`: a peer raised an error that has no class on this side (a bug,
  or a newer peer); ``kind`` is its class name, ``message`` its text.
"""

from __future__ import annotations

__all__ = [
    "Closed",
    "Gone",
    "RemoteError",
    "RequestError",
    "RlferryError",
    "SecurityError",
    "Timeout",
]


class RlferryError(Exception):
    """The base of every exception class rlferry defines."""


class Closed(RlferryError):
    """The resource was closed (by you, or by its owner), then used: make a new one."""


class Gone(RlferryError):
    """The other side went away (died, closed, or never answered): what it held or
    waited for is released; whatever waited on it fails at once with this."""


class Timeout(RlferryError, TimeoutError):
    """A bounded wait ended before what it waited for came."""


class RequestError(RlferryError, ValueError):
    """A value the caller passed is wrong; nothing was stored or sent.

    A request an engine refuses (a token id outside its vocabulary, prompt +
    ``max_tokens`` beyond its context, a bad sampling value) is one too: it fails that
    request only and the engine keeps serving; ``engine`` names the engine that refused
    it (empty where no engine was involved, or the coordinator refused it at submit)."""

    def __init__(self, message: str, engine: str = "") -> None:
        super().__init__(message)
        self.engine = engine


class SecurityError(RlferryError):
    """A bind that would expose a service without a shared secret, a secret too short,
    or a peer that refused this side's secret (or its lack of one)."""


class RemoteError(RlferryError):
    """A peer's handler raised an error this side has no class for; ``kind`` is the
    remote exception's class name, ``message`` its text."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message

    def __reduce__(self) -> tuple[type[RemoteError], tuple[str, str]]:
        return type(self), (self.kind, self.message)
