"""The queue's errors: every one names what was wrong, what was expected, what came, and the fix."""

from __future__ import annotations

from rlferry.errors import Closed, Gone, RemoteError, RequestError, RlferryError, Timeout

__all__ = [
    "GetTimeout",
    "PutTimeout",
    "QueueClosed",
    "QueueError",
    "RemoteError",
    "SchemaError",
    "ServiceGone",
    "UnknownPartition",
    "UnknownTask",
]


class QueueError(RlferryError):
    """Base class of every error the queue raises."""


class SchemaError(QueueError, RequestError):
    """A put or get whose fields, rows, indexes or values do not fit (see the message)."""


class UnknownTask(QueueError, RequestError, KeyError):
    """A task name that was not registered when the queue started."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class UnknownPartition(QueueError, RequestError, KeyError):
    """A partition that does not exist (never put, or cleared)."""

    def __str__(self) -> str:
        return str(self.args[0])


class GetTimeout(QueueError, Timeout):
    """``get`` found too few ready samples before its timeout; nothing was leased."""


class PutTimeout(QueueError, Timeout):
    """``put`` found no room (capacity or max_partitions) before its timeout; nothing was stored."""


class ServiceGone(QueueError, Gone):
    """The controller or a storage unit died or became unreachable."""


class QueueClosed(QueueError, Closed):
    """The client or queue was closed."""


ERRORS: dict[str, type[QueueError]] = {
    cls.__name__: cls
    for cls in (
        QueueError,
        SchemaError,
        UnknownTask,
        UnknownPartition,
        GetTimeout,
        PutTimeout,
        ServiceGone,
        QueueClosed,
    )
}
