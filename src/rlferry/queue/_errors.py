"""The queue's errors: every one names what was wrong, what was expected, what came, and the fix."""

from __future__ import annotations

from rlferry.wire import RemoteError as WireRemoteError

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


class QueueError(Exception):
    """Base class of every error the queue raises."""


class SchemaError(QueueError, ValueError):
    """A put or get whose fields, rows, indexes or values do not fit (see the message)."""


class UnknownTask(QueueError, KeyError):
    """A task name that was not registered when the queue started."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class UnknownPartition(QueueError, KeyError):
    """A partition that does not exist (never put, or cleared)."""

    def __str__(self) -> str:
        return str(self.args[0])


class GetTimeout(QueueError, TimeoutError):
    """``get`` found too few ready samples before its timeout; nothing was leased."""


class PutTimeout(QueueError, TimeoutError):
    """``put`` found no room (capacity or max_partitions) before its timeout; nothing was stored."""


class ServiceGone(QueueError):
    """The controller or a storage unit died or became unreachable."""


class QueueClosed(QueueError):
    """The client or queue was closed."""


class RemoteError(QueueError, WireRemoteError):
    """A service of the queue raised an error the client has no class for (a bug, or a
    newer server): ``kind`` is the remote class name, ``message`` its text."""


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
