"""``StreamingDataset`` and ``StreamingDataLoader``: a partition read as a stream of
``(TensorDict, BatchMeta)`` micro-batches, as TransferQueue's are.

Where TransferQueue sleeps 1 s after an empty batch, this waits for the next put.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..backends import Connection
from ..metadata import BatchMeta
from ._client import TransferQueueClient, backend_of
from ._process import attach, serve_workers

__all__ = [
    "StreamingDataLoader",
    "StreamingDataset",
    "chunk_batch_fn",
    "default_fetch_batch_fn",
]


def default_fetch_batch_fn(
    tq_client: TransferQueueClient,
    data_fields: list[str],
    batch_size: int,
    partition_id: str,
    task_name: str,
    sampling_config: dict[str, Any],
    batch_index: int,
) -> tuple[Any, BatchMeta]:
    """One batch: ``(TensorDict, BatchMeta)``, or ``(None, empty BatchMeta)`` when none is ready."""
    config = {**sampling_config, "batch_index": batch_index, "partition_id": partition_id}
    meta = tq_client.get_meta(
        data_fields=data_fields,
        batch_size=batch_size,
        partition_id=partition_id,
        task_name=task_name,
        sampling_config=config,
    )
    if meta.size == 0:
        return None, meta
    return tq_client.get_data(meta), meta


def chunk_batch_fn(td: Any, batch_meta: BatchMeta, micro_batch_size: int = 1) -> list[Any]:
    """``(TensorDict, BatchMeta)`` micro-batches of ``micro_batch_size`` rows (the last shorter)."""
    from tensordict import TensorDict

    if not isinstance(td, TensorDict):
        raise TypeError(f"Expected TensorDict, got {type(td).__name__}")
    if type(micro_batch_size) is not int or micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size}")
    if len(td.batch_size) == 0:
        raise ValueError("Input TensorDict must have non-empty batch_size")
    total = td.batch_size[0]
    if micro_batch_size > total:
        raise ValueError(
            f"micro_batch_size ({micro_batch_size}) exceeds total batch size ({total})"
        )
    splits = (total + micro_batch_size - 1) // micro_batch_size
    metas = batch_meta.chunk(splits)
    nested: dict[str, tuple[list[Any], Any]] = {}
    for k, v in td.items():
        if isinstance(v, torch.Tensor) and v.is_nested:
            nested[k] = (list(v.unbind(0)), v.layout)
    dense = {k: v for k, v in td.items() if k not in nested}
    dense_td = TensorDict(dense, batch_size=td.batch_size) if dense else None
    out = []
    for i in range(splits):
        a, b = i * micro_batch_size, min((i + 1) * micro_batch_size, total)
        part = dense_td[a:b] if dense_td is not None else TensorDict({}, batch_size=(b - a,))
        for k, (rows, layout) in nested.items():
            part[k] = torch.nested.as_nested_tensor(list(rows[a:b]), layout=layout)
        out.append((part, metas[i]))
    return out


class StreamingDataset(torch.utils.data.IterableDataset):
    """Batches of ``batch_size`` samples of a partition for one task and DP rank, yielded as
    micro-batches. With ``should_check_consumption_status`` the stream ends once the task has
    consumed the whole partition; otherwise it runs until the caller stops (an empty fetch
    waits for the next put instead of sleeping)."""

    def __init__(
        self,
        config: Any,
        batch_size: int,
        micro_batch_size: int,
        data_fields: list[str],
        partition_id: str,
        task_name: str,
        dp_rank: int,
        should_check_consumption_status: bool = False,
        fetch_batch_fn: Callable[..., Any] | None = None,
        process_batch_fn: Callable[..., Any] | None = None,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if len(data_fields) < 1:
            raise ValueError(
                f"data_fields must be a list with at least one field name, got {data_fields}"
            )
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        super().__init__()
        self.config = config
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.data_fields = data_fields
        self.partition_id = partition_id
        self.task_name = task_name
        self.dp_rank = dp_rank
        self.should_check_consumption_status = should_check_consumption_status
        self.fetch_batch_fn = fetch_batch_fn or default_fetch_batch_fn
        self.process_batch_fn = process_batch_fn or chunk_batch_fn
        self.sampling_config = {"dp_rank": dp_rank, "task_name": task_name}
        self.buffer: list[tuple[Any, BatchMeta]] = []
        self.batch_index = 0
        self._tq_client: TransferQueueClient | None = None
        self._connection: Connection | None = None

    def _create_client(self) -> None:
        if self._connection is not None:  # a spawned DataLoader worker: reach the service
            attach(self._connection)
        self._tq_client = TransferQueueClient(f"StreamingDataset_{uuid.uuid4().hex[:8]}")

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a spawned DataLoader worker: with how to reach the queue's service
        (the loader started it), without this process's client."""
        state = dict(self.__dict__)
        state["_tq_client"] = None
        return state

    def _more(self) -> bool:
        assert self._tq_client is not None
        if self.batch_index < len(self.buffer) or not self.should_check_consumption_status:
            return True
        return not self._tq_client.check_consumption_status(self.task_name, self.partition_id)

    def __iter__(self) -> Iterator[Any]:
        if self._tq_client is None:
            self._create_client()
        client = self._tq_client
        assert client is not None
        while self._more():
            if self.batch_index < len(self.buffer):
                current = self.buffer[self.batch_index]
                self.batch_index += 1
                yield from self.process_batch_fn(*current, micro_batch_size=self.micro_batch_size)
                continue
            seen = backend_of(client).controller.version()
            batch, meta = self.fetch_batch_fn(
                tq_client=client,
                data_fields=self.data_fields,
                batch_size=self.batch_size,
                partition_id=self.partition_id,
                task_name=self.task_name,
                sampling_config=self.sampling_config,
                batch_index=self.batch_index,
            )
            if batch is not None:
                self.buffer.append((batch, meta))
            else:
                backend_of(client).controller.wait_change(seen)

    def reset(self) -> None:
        self.batch_index = 0

    def step(self, partition_id: str) -> None:
        self.buffer = []
        self.batch_index = 0
        self.partition_id = partition_id


def _identity(data: Any) -> Any:
    return data


class StreamingDataLoader(torch.utils.data.DataLoader):
    """A DataLoader over a ``StreamingDataset`` (it batches; this passes its batches through).

    With ``num_workers > 0`` each worker process fetches its own batches from the queue
    (every sample goes to one worker, as with TransferQueue): an embedded queue is then
    served from this process over ipc:// (started here, stopped by ``tq.close()``), a
    queue on Ray is reached as any process of the job reaches it. Forked and spawned
    workers both work."""

    def __init__(
        self,
        dataset: StreamingDataset,
        num_workers: int = 0,
        collate_fn: Callable[..., Any] | None = None,
        pin_memory: bool = False,
        worker_init_fn: Callable[..., Any] | None = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
    ) -> None:
        self.dataset: StreamingDataset = dataset
        if num_workers > 0:
            dataset._connection = serve_workers()
        super().__init__(
            dataset=dataset,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=collate_fn or _identity,
            pin_memory=pin_memory,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )

    def reset(self) -> None:
        self.dataset.reset()

    def step(self, partition_id: str) -> None:
        self.dataset.step(partition_id)

    def get_buffer(self) -> list[tuple[Any, BatchMeta]]:
        return self.dataset.buffer
