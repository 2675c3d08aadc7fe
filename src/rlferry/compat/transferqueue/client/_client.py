"""``TransferQueueClient``: TransferQueue's low-level client.

Every method of TransferQueue 0.1.11's client, sync and ``async_`` twin, with its
arguments and return types, over a backend's controller and store: in this process
(embedded) or held by a service (``backends``); a get_meta that must wait waits on
an event, on a thread or on the caller's event loop (on a service: a parked request).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from .._errors import ClientClosed
from ..backends import Backend, Part, RemoteController
from ..metadata import BatchMeta, extract_field_schema, samples_of
from ..state import PICKLED_STORAGE_FILE, STORAGE_FILE
from ._checks import check_get, index_list, key_list
from ._columns import column, empty_tensordict, parsed, rows_of, scatter, tensordict_of
from ._process import current_backend

__all__ = ["AsyncTransferQueueClient", "TransferQueueClient", "backend_of"]

log = logging.getLogger("rlferry.compat.transferqueue")
T = TypeVar("T")


class AsyncTransferQueueClient:
    """TransferQueue's client. Raises ``RuntimeError`` subclasses for controller errors (as
    TransferQueue's client does), ``ValueError``/``TypeError`` for bad arguments,
    ``StorageKeyNotFoundError`` for a sample without the value asked for, ``ClientClosed``
    (a ``RuntimeError``) after ``close()``."""

    def __init__(
        self,
        client_id: str,
        controller_info: Any = None,
        zmq_io_threads: int | None = None,
        zmq_max_sockets: int | None = None,
    ) -> None:
        """TransferQueue's signature; ``controller_info`` and the ZMQ settings are not used
        (the client reaches the queue ``init()`` made)."""
        self.client_id = client_id
        self._backend: Backend | None = current_backend(controller_info)

    def initialize_storage_manager(self, manager_type: str, config: Any) -> None:
        """Kept for signature compatibility: the embedded backend's storage is ready at init."""

    @property
    def _live(self) -> Backend:
        if self._backend is None:
            raise ClientClosed(
                f"client `{self.client_id}`: expected an open client, got one that was closed "
                "(call tq.init() again and use tq.get_client())"
            )
        if self._backend.pid != os.getpid():  # a forked child: reach the queue, not a copy
            self._backend = current_backend()
        return self._backend

    # ---- get_meta ----
    def get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> BatchMeta:
        """Metadata of ``batch_size`` samples of ``partition_id``: ``fetch`` waits (on an event,
        at most ``controller.get_meta_timeout`` s; in polling mode not at all) for samples with
        every field in ``data_fields`` not yet consumed by ``task_name`` and marks the chosen
        ones consumed; ``force_fetch`` returns every sample of the partition, consuming
        nothing; ``insert`` allocates new samples.

        Raises:
            GetMetaTimeout (a RuntimeError): too few ready samples within the timeout.
        """
        ctl = self._live.controller
        check_get(data_fields, batch_size, mode, task_name)
        if mode == "insert":
            return ctl.insert(partition_id, list(data_fields), batch_size)
        if mode == "force_fetch":
            return ctl.force_fetch(partition_id, list(data_fields))
        return ctl.fetch(partition_id, list(data_fields), batch_size, str(task_name),
                         dict(sampling_config or {}))  # fmt: skip

    async def async_get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> BatchMeta:
        if mode != "fetch":
            return self.get_meta(data_fields, batch_size, partition_id, mode, task_name)
        check_get(data_fields, batch_size, mode, task_name)
        return await self._live.controller.async_fetch(
            partition_id, list(data_fields), batch_size, str(task_name), dict(sampling_config or {})
        )

    # ---- put / get ----
    def set_custom_meta(self, metadata: BatchMeta) -> None:
        """Store the batch's ``custom_meta`` at the controller."""
        backend = self._live
        samples = samples_of(metadata)
        if metadata.size == 0 or samples.custom is None:
            return
        for pid, indexes, rows in samples.groups():
            custom = samples.custom if rows is None else [samples.custom[i] for i in rows]
            backend.controller.set_custom(pid, indexes, custom)

    def put(
        self,
        data: Any,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        """Store ``data`` (a TensorDict, one row per sample) for the samples of ``metadata``,
        or for new samples of ``partition_id``; returns the metadata with the new fields.

        Raises:
            ValueError: no partition, or rows that do not match the metadata (nothing is
                stored then).
        """
        backend = self._live
        data = tensordict_of(data)
        n = data.batch_size[0] if len(data.batch_size) else 0
        schema = extract_field_schema(data)  # checks every column's rows first
        if metadata is None:
            if partition_id is None:
                raise ValueError(
                    "partition_id must be provided if metadata is not given: expected "
                    "put(data, partition_id='train_0') or put(data, metadata=meta)"
                )
            metadata = backend.controller.insert(partition_id, list(data.keys()), n)
        if not metadata or metadata.size == 0:
            raise ValueError("metadata cannot be none or empty: expected a BatchMeta of samples")
        if n != metadata.size:
            raise ValueError(
                f"data: expected {metadata.size} rows (the BatchMeta's size), got {n} "
                "(put one row per sample of the metadata)"
            )
        columns = {name: column(data, name, n) for name in data.keys()}  # noqa: SIM118 (a TensorDict)
        if data_parser is not None:
            columns = parsed(columns, data_parser)
        samples = samples_of(metadata)
        custom = samples.custom
        parts: list[Part] = []
        for pid, indexes, rows in samples.groups():
            if rows is None:
                parts.append((pid, indexes, columns, schema, custom))
                continue
            sub = extract_field_schema(data[torch.from_numpy(rows)])
            mine = None if custom is None else [custom[i] for i in rows]
            parts.append((pid, indexes, rows_of(columns, rows), sub, mine))
        backend.put(parts)
        return metadata.add_fields(data)

    def get_data(self, metadata: BatchMeta) -> Any:
        """The values of the batch's fields, a TensorDict in the batch's order.

        Raises:
            StorageKeyNotFoundError: a sample without a value for a field.
        """
        backend = self._live
        if not metadata or metadata.size == 0 or not metadata.field_names:
            log.warning("get_data: empty BatchMeta: returning an empty TensorDict")
            return empty_tensordict()
        from tensordict import TensorDict

        fields = metadata.field_names
        parts = samples_of(metadata).groups()
        if len(parts) == 1:
            pid, indexes, _ = parts[0]
            out = backend.store.get(pid, indexes, fields)
        else:
            pieces = [(rows, backend.store.get(pid, idx, fields)) for pid, idx, rows in parts]
            out = {f: scatter([(r, p[f]) for r, p in pieces], metadata.size) for f in fields}
        return TensorDict(out, batch_size=metadata.size)

    # ---- clearing ----
    def clear_partition(self, partition_id: str) -> None:
        """Drop a partition: its samples, data, keys and consumption. A partition that does not
        exist is logged and left alone (as in TransferQueue)."""
        if not self._live.drop(partition_id):
            log.warning("clear_partition: no partition `%s`: nothing to clear", partition_id)

    def clear_samples(self, metadata: BatchMeta) -> None:
        backend = self._live
        if metadata.size == 0:
            log.warning("clear_samples: empty BatchMeta: nothing to clear")
            return
        backend.clear([(pid, indexes) for pid, indexes, _ in samples_of(metadata).groups()])

    # ---- status ----
    def get_consumption_status(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._live.controller.consumption(partition_id, task_name)

    def get_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._live.controller.production(partition_id, list(data_fields))

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        _, status = self.get_consumption_status(task_name, partition_id)
        return status is not None and status.numel() > 0 and bool(torch.all(status == 1))

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        _, status = self.get_production_status(data_fields, partition_id)
        return status is not None and bool(torch.all(status == 1))

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        self._live.controller.reset_consumption(partition_id, task_name)
        return True

    def get_partition_list(self) -> list[str]:
        return self._live.controller.partitions()

    # ---- keys ----
    def kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool = False
    ) -> BatchMeta:
        ctl = self._live.controller
        keys = key_list(keys)
        return ctl.kv_meta(keys, partition_id, create)

    def kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        ctl = self._live.controller
        global_indexes = index_list(global_indexes)
        keys = ctl.kv_keys(global_indexes, partition_id)
        if len(keys) != len(global_indexes):
            raise RuntimeError(
                f"kv_retrieve_keys: expected a key for each of {global_indexes[:8]} in partition "
                f"`{partition_id}`, got some without (Some global_indexes have no corresponding "
                "keys: they were put without a key, or cleared)"
            )
        return keys

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return self._live.controller.kv_list(partition_id)

    # ---- checkpoints ----
    # Local files at paths the caller names (with the queue as a service, the service writes
    # and reads them, on its own host), in rlferry's checked format: nothing is pickled, and
    # a file that is not whole is refused. A pickle (TransferQueue's own format) is read only
    # with trust_pickle=True.
    def save_controller_checkpoint(self, path: str) -> None:
        self._live.controller.save(path)

    def load_controller_checkpoint(self, path: str, *, trust_pickle: bool = False) -> None:
        self._live.controller.load_from(path, trust_pickle)

    def save_storage_checkpoint(self, checkpoint_dir: str) -> None:
        self._live.store.save(f"{checkpoint_dir}/{STORAGE_FILE}")

    def load_storage_checkpoint(self, checkpoint_dir: str, *, trust_pickle: bool = False) -> None:
        path = Path(checkpoint_dir) / STORAGE_FILE
        if not path.exists() and (Path(checkpoint_dir) / PICKLED_STORAGE_FILE).exists():
            path = Path(checkpoint_dir) / PICKLED_STORAGE_FILE  # TransferQueue's own
        self._live.store.load_from(str(path), trust_pickle)

    def close(self) -> None:
        self._backend = None

    # ---- async twins ----
    async def _off(self, fn: Callable[..., T], *args: Any) -> T:
        """A sync method for an ``async_`` twin: on a service it waits for its requests on a
        thread, so the caller's event loop goes on meanwhile; embedded it runs here (it does
        not wait on anything but memory)."""
        if self._backend is not None and isinstance(self._backend.controller, RemoteController):
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def async_set_custom_meta(self, metadata: BatchMeta) -> None:
        await self._off(self.set_custom_meta, metadata)

    async def async_put(
        self,
        data: Any,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        return await self._off(self.put, data, metadata, partition_id, data_parser)

    async def async_get_data(self, metadata: BatchMeta) -> Any:
        return await self._off(self.get_data, metadata)

    async def async_clear_partition(self, partition_id: str) -> None:
        await self._off(self.clear_partition, partition_id)

    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        await self._off(self.clear_samples, metadata)

    async def async_get_consumption_status(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return await self._off(self.get_consumption_status, task_name, partition_id)

    async def async_get_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return await self._off(self.get_production_status, data_fields, partition_id)

    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        return await self._off(self.check_consumption_status, task_name, partition_id)

    async def async_check_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> bool:
        return await self._off(self.check_production_status, data_fields, partition_id)

    async def async_reset_consumption(
        self, partition_id: str, task_name: str | None = None
    ) -> bool:
        return await self._off(self.reset_consumption, partition_id, task_name)

    async def async_get_partition_list(self) -> list[str]:
        return await self._off(self.get_partition_list)

    async def async_kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool = False
    ) -> BatchMeta:
        return await self._off(self.kv_retrieve_meta, keys, partition_id, create)

    async def async_kv_retrieve_keys(
        self, global_indexes: list[int] | int, partition_id: str
    ) -> list[str]:
        return await self._off(self.kv_retrieve_keys, global_indexes, partition_id)

    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return await self._off(self.kv_list, partition_id)

    async def async_save_controller_checkpoint(self, path: str) -> None:
        await self._off(self.save_controller_checkpoint, path)

    async def async_load_controller_checkpoint(
        self, path: str, *, trust_pickle: bool = False
    ) -> None:
        await self._off(partial(self.load_controller_checkpoint, trust_pickle=trust_pickle), path)

    async def async_save_storage_checkpoint(self, checkpoint_dir: str) -> None:
        await self._off(self.save_storage_checkpoint, checkpoint_dir)

    async def async_load_storage_checkpoint(
        self, checkpoint_dir: str, *, trust_pickle: bool = False
    ) -> None:
        await self._off(
            partial(self.load_storage_checkpoint, trust_pickle=trust_pickle), checkpoint_dir
        )


class TransferQueueClient(AsyncTransferQueueClient):
    """The sync client (TransferQueue's class name); it has the ``async_`` twins too."""

    def _run_coroutine(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine to its end from sync code (TransferQueue's helper, used by its
        module functions): on a private event loop, never on the caller's."""
        return asyncio.run(coro)


def backend_of(client: AsyncTransferQueueClient) -> Backend:
    """The backend ``client`` reaches (in a forked child: the queue, connected again).

    Raises:
        ClientClosed: the client was closed.
    """
    return client._live
