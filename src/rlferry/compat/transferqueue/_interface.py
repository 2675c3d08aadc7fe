"""TransferQueue's module functions: ``init``/``close``/``get_client``, the KV API and its
``async_`` twins, checkpoints."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from . import _checkpoints, _samplers
from ._backend import Backend, Connection, Factory, embedded, remote
from ._client import TransferQueueClient
from ._config import merged_config
from ._errors import NotInitialized
from ._kvmeta import KVBatchMeta
from ._remote import RemoteController

__all__ = [
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "attach",
    "close",
    "current_backend",
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

log = logging.getLogger("rlferry.compat.transferqueue")
T = TypeVar("T")

_BACKEND: Backend | None = None
_CLIENT: TransferQueueClient | None = None
_LAUNCHER: Factory | None = None
_INHERITED: tuple[Connection, str] | None = None
"""In a forked child: how the parent reached its service (connection, address dialed)."""
_PARENT: int | None = None
"""In a forked child of an embedded queue that serves nobody: the parent's pid."""
_NOT_INIT = (
    "TransferQueue is not initialized: expected tq.init() first, got a call before it or "
    "after tq.close() (Please call init() first)"
)


def use_launcher(factory: Factory | None) -> None:
    """Make ``init()`` build its controller and store with ``factory(conf)`` (a launcher that
    runs them as services elsewhere); ``None`` goes back to the built-in choice."""
    global _LAUNCHER
    _LAUNCHER = factory


def _after_fork() -> None:
    """A forked child (a DataLoader worker) keeps how its parent reached the queue's state,
    not the parent's objects: an embedded backend there would be a stale copy, and sockets
    do not survive a fork. Its first call connects again (``current_backend``)."""
    global _BACKEND, _CLIENT, _INHERITED, _PARENT
    if _BACKEND is not None and _BACKEND.connection is not None:
        link = getattr(_BACKEND.controller, "link", None)
        _INHERITED = (_BACKEND.connection, link.address if link else _BACKEND.connection.address)
    elif _BACKEND is not None:
        _PARENT = _BACKEND.pid
    _BACKEND = _CLIENT = None


os.register_at_fork(after_in_child=_after_fork)


def current_backend(_controller_info: Any = None) -> Backend:
    """The backend of this process: the one ``init()`` made; in a forked child of that
    process (a DataLoader worker) or in a Ray worker of a job whose driver runs the queue on
    Ray, one connected to the queue's service (made on first use)."""
    global _BACKEND
    if _BACKEND is not None and _BACKEND.pid == os.getpid():
        if not _ended(_BACKEND):
            return _BACKEND
        _drop()  # its actor died: a reused Ray worker connects to the job's new one
    if _INHERITED is not None:
        connection, address = _INHERITED
        _BACKEND = remote(connection, address)
        return _BACKEND
    if _PARENT is not None:
        raise RuntimeError(
            f"process {os.getpid()}: expected the process that called tq.init() "
            f"({_PARENT}) or a child that can reach its queue, got a forked child of an "
            "embedded queue that serves no other process (a StreamingDataLoader with "
            "num_workers > 0 serves its workers; for other processes run the queue on Ray: "
            "ray.init() before tq.init())"
        )
    if _in_ray_worker():
        from . import _ray

        found = _ray.attach()
        if found is not None:
            _BACKEND = found
            return _BACKEND
    raise NotInitialized(_NOT_INIT)


def _ended(backend: Backend) -> bool:
    """A backend on a Ray actor that Ray reported dead."""
    watch = backend.connection.watch if backend.connection is not None else None
    if watch is None:
        return False
    from rlferry.ray._common import deaths

    return deaths.ended(watch)


def _drop() -> None:
    global _BACKEND, _CLIENT
    backend, _BACKEND, _CLIENT = _BACKEND, None, None
    if backend is not None:
        backend.close()


def _in_ray_worker() -> bool:
    """True in a task or actor of a Ray job (not its driver)."""
    ray = sys.modules.get("ray")
    return bool(
        ray is not None
        and ray.is_initialized()
        and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    )


def serve_workers() -> Connection:
    """How this process's children reach the queue's state: for an embedded backend, serve
    it from this process over ipc:// (on the wire loop, until ``tq.close()``)."""
    backend = current_backend()
    if backend.connection is None:
        from rlferry.wire import default_address, wire_loop

        from ._service import serve

        loop = wire_loop()
        service, (address,) = loop.run(serve(backend, [default_address("ipc")]))
        timeout = float(backend.controller.timeout)
        backend.connection, backend.service = Connection(address, None, timeout), service
        backend.on_close.insert(0, lambda: wire_loop().run(service.close()))
    return backend.connection


def attach(connection: Connection) -> None:
    """Reach the queue's state through ``connection`` in a process that did not inherit it
    (a spawned DataLoader worker)."""
    global _BACKEND, _CLIENT
    if _INHERITED is None and (_BACKEND is None or _BACKEND.pid != os.getpid()):
        _BACKEND, _CLIENT = remote(connection), None


def _sampler(spec: Any) -> _samplers.BaseSampler:
    if isinstance(spec, _samplers.BaseSampler):
        return spec
    if isinstance(spec, type) and issubclass(spec, _samplers.BaseSampler):
        return spec()
    names = [n for n in _samplers.__all__ if n.endswith("Sampler") and n != "BaseSampler"]
    if isinstance(spec, str) and spec in names:
        made: _samplers.BaseSampler = getattr(_samplers, spec)()
        return made
    raise ValueError(
        f"Could not find sampler {spec!r}: expected one of {names}, a BaseSampler subclass or "
        "an instance (config `controller.sampler`)"
    )


def _on_ray(final: Any) -> bool:
    """Ray is running in this process, or the configuration names a Ray node resource for
    the storage (``backend.SimpleStorage.required_node_resource``)."""
    if final.backend.SimpleStorage.required_node_resource is not None:
        return True
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def init(conf: Any = None) -> Any:
    """Start the TransferQueue system, or connect to the one the job runs.

    Embedded in this process by default. When Ray is initialised (or ``conf`` names
    ``backend.SimpleStorage.required_node_resource``), the queue's state is a named Ray
    actor of the job: the first ``init`` starts it, ``init`` in any other task or actor
    of the job connects to it (``conf`` is then not used, as in TransferQueue). With a
    launcher registered by ``use_launcher``, its factory builds the backend. A second
    call reuses what the first made and returns ``conf`` as given.

    Returns:
        The merged configuration (an OmegaConf ``DictConfig``).

    Raises:
        ValueError: an unknown configuration key or an unsupported setting.
    """
    global _BACKEND, _CLIENT
    if _BACKEND is not None and _BACKEND.pid == os.getpid():
        if not _ended(_BACKEND):
            return conf
        _drop()
    if _INHERITED is not None:
        current_backend()
        _CLIENT = TransferQueueClient(client_id=f"TransferQueueClient_{os.getpid()}")
        return conf
    final = merged_config(conf)
    sampler = _sampler(final.controller.sampler)
    if _LAUNCHER is not None:
        _BACKEND = _LAUNCHER(final)
    elif _on_ray(final):
        from . import _ray

        _BACKEND = _ray.start(final, sampler)
    else:
        _BACKEND = embedded(final, sampler)
    _CLIENT = TransferQueueClient(client_id=f"TransferQueueClient_{os.getpid()}")
    return final


def close() -> None:
    """Drop the system: the client, and in the process that started it the queue's state
    (every sample; on Ray the service actor). Elsewhere only this process's connection."""
    global _BACKEND, _CLIENT
    if _CLIENT is not None:
        _CLIENT.close()
    backend, _CLIENT, _BACKEND = _BACKEND, None, None
    if backend is not None and backend.pid == os.getpid():
        backend.close()


def get_client() -> TransferQueueClient:
    """The client ``init()`` made, for TransferQueue's low-level API (in a Ray worker of a
    job that runs the queue on Ray, one connected to it)."""
    try:
        return _client()
    except NotInitialized:
        raise NotInitialized(
            "Please initialize the TransferQueue first by calling `tq.init()`: expected an "
            "initialized system, got none"
        ) from None


def get_metrics_endpoint() -> str | None:
    """Always None: the shim has no Prometheus exporter (``metrics.enabled`` is refused)."""
    return None


def _client() -> TransferQueueClient:
    global _CLIENT
    if _CLIENT is None or _BACKEND is None or _BACKEND.pid != os.getpid() or _ended(_BACKEND):
        current_backend()  # connects where the process can reach a running queue
        _CLIENT = TransferQueueClient(client_id=f"TransferQueueClient_{os.getpid()}")
    return _CLIENT


# ---- KV API ----
def kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Put one sample under ``key``: its fields (a dict of per-sample values or a TensorDict
    of one row) and/or its tag. Returns the key's KVBatchMeta with every field it holds."""
    if fields is None and tag is None:
        raise ValueError("Please provide at least one parameter of fields or tag.")
    if fields is not None:
        fields = _one_row(fields)
    return _kv_put([key], partition_id, fields, None if tag is None else [tag], data_parser)


def _one_row(fields: Any) -> Any:
    from tensordict import NonTensorStack, TensorDict

    if isinstance(fields, TensorDict):
        return fields
    if not isinstance(fields, dict):
        raise ValueError(
            f"fields: expected a dict or a TensorDict, got {type(fields).__name__} "
            "(`fields` can only be dict or TensorDict)"
        )
    row: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise ValueError(
                    f"field `{name}`: expected one sample's value, got a nested tensor (a batch: "
                    "Please use (async)kv_batch_put for batch operation)"
                )
            row[name] = value.unsqueeze(0)
        else:
            row[name] = NonTensorStack(value)
    return TensorDict(row, batch_size=[1])


def _kv_put(
    keys: list[str],
    partition_id: str,
    fields: Any,
    tags: list[dict[str, Any]] | None,
    data_parser: Callable[[Any], Any] | None,
) -> KVBatchMeta:
    client = _client()
    if fields is not None and fields.batch_size[0] != len(keys):
        raise ValueError(
            f"`keys` with length {len(keys)} does not match the `fields` TensorDict with "
            f"batch_size {fields.batch_size[0]}: expected one row per key"
        )
    if tags is not None and len(tags) != len(keys):
        raise ValueError(
            f"keys with length {len(keys)} does not match length of tags {len(tags)}: "
            "expected one tag dict per key"
        )
    meta = client.kv_retrieve_meta(keys=keys, partition_id=partition_id, create=True)
    if meta.size != len(keys):
        raise RuntimeError(
            f"Retrieved BatchMeta size {meta.size} does not match with input `keys` size "
            f"{len(keys)}: expected one sample per key (duplicated keys?)"
        )
    if tags is not None:
        meta.update_custom_meta(tags)
    if fields is not None:
        meta = client.put(fields, meta, data_parser=data_parser)
    else:
        client.set_custom_meta(meta)
    return KVBatchMeta(
        keys=list(keys),
        tags=meta.custom_meta,
        partition_id=partition_id,
        fields=meta.field_names,
        extra_info=meta.extra_info,
    )


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Put many samples, one row of ``fields`` (a TensorDict) and one tag per key."""
    if fields is None and tags is None:
        raise ValueError("Please provide at least one parameter of `fields` or `tags`.")
    return _kv_put(list(keys), partition_id, fields, tags, data_parser)


def kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> Any:
    """The values of ``keys`` (all their common fields, or ``select_fields``), a TensorDict.

    Raises:
        ValueError: no such keys or partition, or a field some of the keys lack.
    """
    client = _client()
    meta = client.kv_retrieve_meta(keys=keys, partition_id=partition_id, create=False)
    if meta.size == 0:
        raise ValueError(
            f"keys or partition were not found! expected keys {keys!r} in partition "
            f"`{partition_id}` (partitions: {client.get_partition_list()})"
        )
    wanted = [keys] if isinstance(keys, str) else list(keys)
    if meta.size < len(set(wanted)):  # TransferQueue returns the others without a word
        found = set(client.kv_retrieve_keys(list(map(int, meta.global_indexes)), partition_id))
        missing = [k for k in wanted if k not in found]
        raise ValueError(
            f"keys were not found! expected keys of partition `{partition_id}`, got "
            f"{missing[:8]!r} that it does not hold (kv_put them first, or leave them out)"
        )
    if not meta.field_names:
        raise ValueError(
            f"no fields to read! expected keys {wanted[:8]!r} of `{partition_id}` with fields, "
            "got keys that hold only tags (kv_put their fields first)"
        )
    if select_fields is not None:
        wanted = [select_fields] if isinstance(select_fields, str) else list(select_fields)
        lacking = [f for f in wanted if f not in meta.field_schema]
        if lacking:
            raise ValueError(
                f"Some fields are not ready in all the requested keys! expected fields {lacking} "
                f"in each of {meta.size} keys of `{partition_id}`, got keys without them "
                f"(fields all these keys hold: {meta.field_names})"
            )
        meta = meta.select_fields(wanted)
    if not meta.is_ready:
        raise ValueError(
            f"Some fields are not ready in all the requested keys! expected fields "
            f"{meta.field_names or select_fields} for each of {meta.size} keys of "
            f"`{partition_id}`, "
            "got some keys without them (kv_batch_get keys that have the same fields)"
        )
    return client.get_data(meta)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Any:
    """``kv_batch_get`` for the keys, partition and fields of a ``KVBatchMeta``."""
    if meta.partition_id is None:
        raise ValueError("Must provide partition_id in the input KVBatchMeta.")
    fields = meta.fields
    if select_fields is not None:
        fields = [select_fields] if isinstance(select_fields, str) else list(select_fields)
        if meta.fields is None or any(f not in meta.fields for f in fields):
            raise ValueError(
                f"Some fields assigned in select_fields not found in the metadata. "
                f"Assigned: {fields}; Fields in KVBatchMeta: {meta.fields}."
            )
    return kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """``{partition: {key: tags}}`` of one partition or all."""
    return _client().kv_list(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Drop the samples of ``keys`` (keys that do not exist are ignored)."""
    client = _client()
    meta = client.kv_retrieve_meta(
        keys=[keys] if isinstance(keys, str) else keys, partition_id=partition_id, create=False
    )
    if meta.size > 0:
        client.clear_samples(meta)


async def _off(fn: Callable[..., T], *args: Any) -> T:
    """A KV call for its ``async_`` twin: with the queue as a service, on a thread (the
    caller's event loop goes on while it waits for the service); embedded, here."""
    try:
        served = isinstance(current_backend().controller, RemoteController)
    except NotInitialized:
        served = False  # the call raises it, named
    if served:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def async_kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    return await _off(kv_put, key, partition_id, fields, tag, data_parser)


async def async_kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    return await _off(kv_batch_put, keys, partition_id, fields, tags, data_parser)


async def async_kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> Any:
    return await _off(kv_batch_get, keys, partition_id, select_fields)


async def async_kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: list[str] | str | None = None
) -> Any:
    return await _off(kv_batch_get_by_meta, meta, select_fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    return await _off(kv_list, partition_id)


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    await _off(kv_clear, keys, partition_id)


# ---- checkpoints ----
def save_checkpoint(
    checkpoint_dir: str | Path,
    *,
    include_storage: bool = True,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write the whole state (controller, and the data: it lives in memory, so always) to
    ``checkpoint_dir``, replacing an earlier checkpoint there only once the new one is whole.

    Raises:
        RuntimeError: not initialized.
    """
    if _CLIENT is None:
        raise RuntimeError("TransferQueue is not initialized. Call tq.init() first.")
    _checkpoints.save(_CLIENT, Path(checkpoint_dir), metadata)


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Restore the state ``save_checkpoint`` wrote (a checkpoint is trusted: it is unpickled).

    Raises:
        FileNotFoundError: no checkpoint there. RuntimeError: not initialized.
    """
    if _CLIENT is None:
        raise RuntimeError("TransferQueue is not initialized. Call tq.init() first.")
    _checkpoints.load(_CLIENT, Path(checkpoint_dir))
