"""The rollout-to-training data plane: a columnar, streaming, DP-aware queue.

>>> with Queue(storage_units=2, tasks=("actor_train",)) as q:
...     c = q.client()
...     idx = c.put("train_0", {"rewards": torch.tensor([1.0, 0.0])})
...     b = c.get("train_0", task="actor_train", batch_size=2, fields=["rewards"])
...     c.ack(b)

The services a launcher runs (the controller, the storage units) are in
:mod:`rlferry.queue.services`; the records of ``statistics()`` in
:mod:`rlferry.queue.statistics`.
"""

import importlib
import warnings
from typing import Any

from ._client import AsyncQueueClient, Batch
from ._config import QueueConfig
from ._dist import get_broadcast
from ._errors import (
    GetTimeout,
    PutTimeout,
    QueueClosed,
    QueueError,
    SchemaError,
    ServiceGone,
    UnknownPartition,
    UnknownTask,
)
from ._queue import Queue
from ._samplers import GrpoGroups, SeqlenBalanced, Sequential
from ._sync_client import QueueClient
from .statistics import QueueStatistics

__all__ = [
    "AsyncQueueClient",
    "Batch",
    "GetTimeout",
    "GrpoGroups",
    "PutTimeout",
    "Queue",
    "QueueClient",
    "QueueClosed",
    "QueueConfig",
    "QueueError",
    "QueueStatistics",
    "SchemaError",
    "SeqlenBalanced",
    "Sequential",
    "ServiceGone",
    "UnknownPartition",
    "UnknownTask",
    "get_broadcast",
]

# Names no longer in the public surface, importable from here for one release:
# name -> (the module that holds it, what the warning advises).
_MOVED = {
    "ControllerService": ("rlferry.queue.services", "import it from rlferry.queue.services"),
    "StorageService": ("rlferry.queue.services", "import it from rlferry.queue.services"),
    "RemoteError": ("rlferry.errors", "import it from rlferry.errors"),
    "WARN_AFTER": (
        "rlferry.queue._client",
        "it is a constant of AsyncQueueClient.get (a get that waits 5 s for fields no put "
        "brought logs a warning)",
    ),
}


def __getattr__(name: str) -> Any:
    moved = _MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module 'rlferry.queue' has no attribute {name!r}")
    module, advice = moved
    warnings.warn(f"rlferry.queue.{name} is deprecated: {advice}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
