"""TransferQueue 0.1.11's public API (import name ``transfer_queue``) on rlferry.

Switch an existing verl or slime integration with one line at start-up::

    import rlferry.compat.transferqueue as tqc; tqc.install()
    import transfer_queue as tq  # now rlferry's
    tq.init()

Needs the ``[tq]`` extra (tensordict, omegaconf). Embedded by default: no Ray,
no cluster. With Ray up, ``tq.init()`` in the driver runs the queue's state as a
named actor of the job, which every task and actor reaches (``tq.init()`` or
``get_client()`` there); a ``StreamingDataLoader`` with workers serves an embedded
queue to them. ``use_launcher(factory)`` plugs in another backend.

Its parts, bottom up: ``metadata`` (``BatchMeta``, ``KVBatchMeta``, held as arrays),
``samplers``, ``state`` (the controller and the store that hold the queue's state),
``backends`` (where that state lives: this process, a service process, a Ray actor), and
``client`` (the client, the module functions, the streaming loader); ``install()`` maps
``transfer_queue``'s module names onto them.
"""

from ._errors import (
    ClientClosed,
    GetMetaTimeout,
    NotInitialized,
    ServiceGone,
    StorageKeyNotFoundError,
)
from ._install import install, uninstall
from .client import (
    AsyncTransferQueueClient,
    StreamingDataLoader,
    StreamingDataset,
    TransferQueueClient,
    async_kv_batch_get,
    async_kv_batch_get_by_meta,
    async_kv_batch_put,
    async_kv_clear,
    async_kv_list,
    async_kv_put,
    close,
    get_client,
    get_metrics_endpoint,
    init,
    kv_batch_get,
    kv_batch_get_by_meta,
    kv_batch_put,
    kv_clear,
    kv_list,
    kv_put,
    load_checkpoint,
    save_checkpoint,
    use_launcher,
)
from .metadata import BatchMeta, KVBatchMeta
from .samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
)

__version__ = "0.1.11"
"""The TransferQueue version whose API this is."""

__all__ = [
    "AsyncTransferQueueClient",
    "BaseSampler",
    "BatchMeta",
    "ClientClosed",
    "GRPOGroupNSampler",
    "GetMetaTimeout",
    "KVBatchMeta",
    "NotInitialized",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "ServiceGone",
    "StorageKeyNotFoundError",
    "StreamingDataLoader",
    "StreamingDataset",
    "TransferQueueClient",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "install",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
    "uninstall",
    "use_launcher",
]
