"""The exceptions of the TransferQueue API, of the types TransferQueue raises.

TransferQueue's client wraps a controller error into ``RuntimeError``; its storage
raises ``StorageKeyNotFoundError`` (a ``KeyError``); its module functions assert
that ``init()`` ran. Each class here is a subclass of that type, so ``except``
clauses written for TransferQueue catch them, with a message naming what was
expected, what came and the fix. Each is also the error rlferry's queue raises for the
same end where that keeps TransferQueue's type first (``ClientClosed`` is a
``QueueClosed``, ``ServiceGone`` the queue's ``ServiceGone``), so ``rlferry.errors``'
families catch those too.
"""

from __future__ import annotations

from rlferry.queue import QueueClosed, QueueError
from rlferry.queue import ServiceGone as QueueServiceGone

__all__ = [
    "ClientClosed",
    "GetMetaTimeout",
    "NotInitialized",
    "ServiceGone",
    "StorageKeyNotFoundError",
]


class StorageKeyNotFoundError(QueueError, KeyError):
    """A requested sample has no value for a field (cleared, or never put)."""

    def __str__(self) -> str:  # KeyError quotes its message; this one is a sentence
        return str(self.args[0]) if self.args else ""


class GetMetaTimeout(QueueError, RuntimeError):
    """``get_meta`` waited its whole timeout and too few samples were ready (a
    ``RuntimeError``, as TransferQueue raises, not a ``TimeoutError``: code written for
    TransferQueue that catches ``OSError`` must not catch it)."""


class ClientClosed(QueueClosed, RuntimeError):
    """A call on a client after ``close()``."""


class ServiceGone(QueueServiceGone, RuntimeError):
    """The process that holds the queue's state (a service process, or its Ray actor) died or
    stopped answering; the message names it and, on Ray, Ray's reason."""


class NotInitialized(QueueError, AssertionError):
    """A module function called before ``init()`` or after ``close()``."""
