"""The ``rlferry`` weight-transfer backend of vLLM, trainer side."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from rlferry.errors import RequestError
from rlferry.weights import PushReport, SenderClosed, WeightSender, WeightSyncError

__all__ = ["LLMClient", "RlferryTrainerEngine", "RlferryTrainerInitInfo"]


@dataclass
class RlferryTrainerInitInfo(TrainerInitInfo):
    """The trainer side's settings (``rank`` is this trainer process's rank: rank 0 sends).

    ``transport``: ``"shm"`` (CPU tensors, vLLM on this host), ``"cuda_ipc"`` (vLLM on
    the trainer's GPU) or ``"broadcast"`` (other GPUs or hosts); ``receivers``: how many
    vLLM workers the first push waits for (tensor x pipeline x data parallel);
    ``group``, ``bind``, ``secret``, ``bucket_bytes``: the ``WeightSender``'s (a bind off
    loopback needs a secret of 16+ bytes); ``engine``: the receivers' name (push failures
    name it; default ``vllm:HOST:PID``); ``timeout``: seconds each update may take (the
    push, and the engine's wait for its commit)."""

    backend: ClassVar[str] = "rlferry"

    group: str = "vllm"
    transport: str = "shm"
    receivers: int = 1
    bind: str | None = None
    secret: str | None = None
    bucket_bytes: int | None = None
    engine: str | None = None
    timeout: float = 60.0

    def __post_init__(self) -> None:
        # transport, receivers, bind, secret, bucket_bytes: WeightSender checks them
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise RequestError(
                f"RlferryTrainerInitInfo.timeout: expected a number > 0, got {self.timeout!r}"
            )


class RlferryTrainerEngine(TrainerWeightTransferEngine):
    """vLLM's trainer-side engine of the ``rlferry`` backend::

        info = RlferryTrainerInitInfo(rank=0, transport="shm")
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=src)
        engine.send_weights(version=7)   # vLLM serves weight_version "7"

    ``trainer_init`` makes a ``WeightSender`` and has vLLM's workers join it
    (``client.init_weight_transfer_engine``). ``send_weights(version=None,
    source=None)`` runs one update: ``client.start_weight_update()``, then
    ``client.update_weights({"version": v, ...})`` on a thread while the sender pushes
    the source, then ``client.finish_weight_update(weight_version=str(v))``. ``version``
    is an int: the argument, else ``self.version + 1`` (``self.version`` is the last
    version sent, 0 before the first). ``source``: a vLLM ``WeightSource`` (streamed
    against its ``metadata()``: FSDP shards are gathered tensor by tensor) or any
    re-iterable of ``(name, tensor)`` such as ``model.state_dict().items()`` (read in
    place: zero copy over shm and cuda_ipc); default the one given at ``trainer_init``.
    Returns the push's ``PushReport`` (None on a rank that does not send).

    End of life: :meth:`close` (or ``with``) closes the ``WeightSender``;
    :meth:`shutdown`, the name vLLM's ``TrainerWeightTransferEngine`` gives it, does the
    same.

    Raises (``send_weights``):
        WeightSyncError: a receiver failed or rejected the push (``failures`` names
            each vLLM worker's receiver and its reason) or the engine's
            ``update_weights`` failed; ``finish_weight_update`` is not called and vLLM
            keeps serving its previous version label. A ``SenderClosed`` (one of them)
            after :meth:`close`.
    """

    init_info_cls = RlferryTrainerInitInfo

    def __init__(
        self,
        *,
        client: Any,
        source: Any = None,
        is_sender: bool = True,
        sender: WeightSender | None = None,
        timeout: float = 60.0,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender = sender
        self.timeout = timeout
        self.version = 0
        self.last_report: PushReport | None = None

    @classmethod
    def trainer_init(
        cls, init_info: RlferryTrainerInitInfo, *, client: Any, source: Any = None
    ) -> RlferryTrainerEngine:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     timeout=init_info.timeout)  # fmt: skip
        if not engine.is_sender:
            return engine
        sender = WeightSender(
            group=init_info.group, transport=init_info.transport, receivers=init_info.receivers,
            bind=init_info.bind, secret=init_info.secret, bucket_bytes=init_info.bucket_bytes,
        )  # fmt: skip
        payload: dict[str, Any] = {"group": init_info.group, "address": sender.address}
        for key, value in (("secret", init_info.secret), ("name", init_info.engine)):
            if value is not None:
                payload[key] = value
        try:
            client.init_weight_transfer_engine(payload)
        except BaseException:
            sender.close()
            raise
        engine.sender = sender
        return engine

    def send_weights(self, *, version: int | None = None, source: Any = None) -> PushReport | None:
        source = self.source if source is None else source
        if source is None:
            raise RequestError(
                "send_weights: expected a source (at trainer_init or here), got None"
            )
        named, layout = _named(source)
        if not self.is_sender:
            for _ in named:  # every rank gathers (FSDP's full_tensor is a collective)
                pass
            return None
        if version is None:
            version = self.version + 1
        if type(version) is not int or version < 0:
            raise RequestError(f"send_weights.version: expected an int >= 0, got {version!r}")
        if self.sender is None:
            raise SenderClosed(
                f"send_weights of version {version}: this trainer engine was closed (make a "
                "new one with trainer_init)"
            )
        timeout = self.timeout
        self.client.start_weight_update()
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlferry-vllm-update")
        try:
            update = pool.submit(
                self.client.update_weights, {"version": version, "timeout": timeout}
            )
            try:
                report = self.sender.push(named, version=version, timeout=timeout, layout=layout)
            except WeightSyncError:
                # the engine's update_weights sees the failure too and ends: let it
                concurrent.futures.wait([update], timeout + 30)
                raise
            try:
                update.result(timeout + 30)
            except concurrent.futures.TimeoutError:
                raise WeightSyncError(
                    f"send_weights of version {version}: the engine's update_weights did not "
                    f"return within {timeout + 30:g} s after the push committed"
                ) from None
            except Exception as e:
                raise WeightSyncError(
                    f"send_weights of version {version}: the push committed, but the engine's "
                    f"update_weights failed: {type(e).__name__}: {e}"
                ) from e
        finally:
            pool.shutdown(wait=False)
        self.client.finish_weight_update(weight_version=str(version))
        self.version, self.last_report = version, report
        return report

    def close(self) -> None:
        """Close the ``WeightSender`` (the receivers see it go); a second call does nothing."""
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()

    def shutdown(self) -> None:
        """:meth:`close`, by the name of vLLM's ``TrainerWeightTransferEngine`` API (code
        written against vLLM's factory calls it for any backend)."""
        self.close()

    def __enter__(self) -> RlferryTrainerEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _named(source: Any) -> tuple[Iterable[tuple[str, torch.Tensor]], list[Any] | None]:
    """What to push from ``source``, and its layout when streamed."""
    if isinstance(source, WeightSource):
        return iter(source), [(m.name, m) for m in source.metadata()]
    return source, None


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` over an offline ``vllm.LLM`` in this process
    (vLLM ships HTTP and Ray clients only)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
