"""The sync queue client: :class:`~._client.AsyncQueueClient`'s calls, blocking, on the
process's wire loop."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from rlferry.wire import wire_loop
from rlferry.wire.lowlevel import CONNECT_TIMEOUT

from ._client import AsyncQueueClient, Batch
from ._samplers import GrpoGroups, SeqlenBalanced, Sequential
from .statistics import QueueStatistics

__all__ = ["QueueClient"]

T = TypeVar("T")


class QueueClient:
    """The sync client: the same methods as :class:`AsyncQueueClient`, blocking.

    Safe to share between threads; runs on the process's wire loop. Lifecycle:
    ``close()`` (idempotent) closes it, and ``with`` closes it on exit; a call after
    that raises :class:`~rlferry.queue.QueueClosed`.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: str | bytes | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        dial: Callable[[str], str] | None = None,
        why_gone: Callable[[str, str], Awaitable[str]] | None = None,
    ) -> None:
        self._loop = wire_loop()
        self._client = AsyncQueueClient(
            address, secret=secret, connect_timeout=connect_timeout, dial=dial, why_gone=why_gone
        )
        self.address = address

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    def put(
        self,
        partition: str,
        data: dict[str, Any],
        *,
        meta: Mapping[str, Sequence[Any]] | None = None,
        indexes: Sequence[int] | None = None,
        partition_meta: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        return self._run(
            self._client.put(
                partition, data, meta=meta, indexes=indexes, partition_meta=partition_meta,
                timeout=timeout,
            )
        )  # fmt: skip

    def get(
        self,
        partition: str,
        *,
        task: str,
        batch_size: int,
        fields: Sequence[str],
        dp_rank: int = 0,
        dp_size: int = 1,
        sampler: str | Sequential | GrpoGroups | SeqlenBalanced = "sequential",
        timeout: float | None = None,
    ) -> Batch:
        return self._run(
            self._client.get(
                partition, task=task, batch_size=batch_size, fields=fields, dp_rank=dp_rank,
                dp_size=dp_size, sampler=sampler, timeout=timeout,
            )
        )  # fmt: skip

    def ack(self, batch: Batch) -> int:
        return self._run(self._client.ack(batch))

    def clear(self, partition: str) -> int:
        return self._run(self._client.clear(partition))

    def statistics(self) -> QueueStatistics:
        return self._run(self._client.statistics())

    def close(self) -> None:
        """Close the links to the queue's services; a second call does nothing."""
        self._run(self._client.aclose())

    def __enter__(self) -> QueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


for _name in ("put", "get", "ack", "clear", "statistics"):
    getattr(QueueClient, _name).__doc__ = getattr(AsyncQueueClient, _name).__doc__
