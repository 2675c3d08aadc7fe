"""The rollout-to-training data plane: a columnar, streaming, DP-aware queue.

>>> with Queue.start(storage_units=2, tasks=("actor_train",)) as q:
...     c = q.client()
...     idx = c.put("train_0", {"rewards": torch.tensor([1.0, 0.0])})
...     b = c.get("train_0", task="actor_train", batch_size=2, fields=["rewards"])
...     c.ack(b)
"""

from ._client import WARN_AFTER, AsyncQueueClient, Batch, QueueClient
from ._config import QueueConfig
from ._dist import get_broadcast
from ._errors import (
    GetTimeout,
    PutTimeout,
    QueueClosed,
    QueueError,
    RemoteError,
    SchemaError,
    ServiceGone,
    UnknownPartition,
    UnknownTask,
)
from ._queue import Queue
from ._samplers import GrpoGroups, SeqlenBalanced, Sequential
from ._serve import ControllerService, StorageService

__all__ = [
    "WARN_AFTER",
    "AsyncQueueClient",
    "Batch",
    "ControllerService",
    "GetTimeout",
    "GrpoGroups",
    "PutTimeout",
    "Queue",
    "QueueClient",
    "QueueClosed",
    "QueueConfig",
    "QueueError",
    "RemoteError",
    "SchemaError",
    "SeqlenBalanced",
    "Sequential",
    "ServiceGone",
    "StorageService",
    "UnknownPartition",
    "UnknownTask",
    "get_broadcast",
]
