"""TransferQueue's client side: the client class (``TransferQueueClient``), the module
functions (``init``, ``get_client``, the KV API, checkpoints), the streaming dataset and
loader, and how a process reaches the queue's state (``current_backend``)."""

from ._checkpoints import load_checkpoint, save_checkpoint
from ._client import AsyncTransferQueueClient, TransferQueueClient
from ._dataset import (
    StreamingDataLoader,
    StreamingDataset,
    chunk_batch_fn,
    default_fetch_batch_fn,
)
from ._interface import close, get_client, get_metrics_endpoint, init
from ._kv import (
    async_kv_batch_get,
    async_kv_batch_get_by_meta,
    async_kv_batch_put,
    async_kv_clear,
    async_kv_list,
    async_kv_put,
    kv_batch_get,
    kv_batch_get_by_meta,
    kv_batch_put,
    kv_clear,
    kv_list,
    kv_put,
)
from ._process import attach, current_backend, serve_workers, use_launcher

__all__ = [
    "AsyncTransferQueueClient",
    "StreamingDataLoader",
    "StreamingDataset",
    "TransferQueueClient",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "attach",
    "chunk_batch_fn",
    "close",
    "current_backend",
    "default_fetch_batch_fn",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
    "serve_workers",
    "use_launcher",
]
