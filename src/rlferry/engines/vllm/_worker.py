"""The ``rlferry`` weight-transfer backend of vLLM, worker side, and the worker extension.

This module runs inside vLLM's worker process (imported there through
``worker_extension_cls`` or the engine factory's registry). The backend's object lives
in the worker and holds an rlferry ``WeightReceiver`` joined to the trainer's
``WeightSender``; the worker's weight-update calls drive it (see :mod:`._vllm_gate`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlferry.errors import RequestError
from rlferry.weights import WeightReceiver
from rlferry.weights.planning import TensorSpec

from .._errors import NotStarted
from ._checkpoint import checkpoint_check
from ._gate import Gate, GateError
from ._lora import PushedAdapter

__all__ = ["RlferryInitInfo", "RlferryUpdateInfo", "RlferryWeightTransferEngine", "WorkerExtension"]

log = logging.getLogger("rlferry.engines")


def _positive(owner: str, field: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise RequestError(f"{owner}.{field}: expected a number > 0 (seconds), got {value!r}")


@dataclass
class RlferryInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the trainer's sender (``init_weight_transfer_engine``'s
    ``init_info``): the sender's ``group`` and ``address``, its ``secret`` for an
    address off loopback, the receiver's ``name`` (push failures name it; default
    ``vllm:HOST:PID``, with ``:rankN`` added when the engine has several workers) and
    ``timeout``: seconds to join, and the most a pushed bucket waits for
    ``update_weights`` to open the gate."""

    group: str
    address: str
    secret: str | None = None
    name: str | None = None
    timeout: float = 30.0
    verify: bool = False

    def __post_init__(self) -> None:
        for field in ("group", "address"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise RequestError(f"init_info.{field}: expected a non-empty str, got {value!r}")
        for field in ("secret", "name"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(
                    f"init_info.{field}: expected None or a non-empty str, got {value!r}"
                )
        _positive("init_info", "timeout", self.timeout)
        if not isinstance(self.verify, bool):
            raise RequestError(f"init_info.verify: expected a bool, got {self.verify!r}")


@dataclass
class RlferryUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``' ``update_info``: the ``version`` the trainer pushes (None: the
    next one the receiver commits) and ``timeout``, the seconds to wait for its commit."""

    version: int | None = None
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.version is not None and (type(self.version) is not int or self.version < 0):
            raise RequestError(
                f"update_info.version: expected None or an int >= 0, got {self.version!r}"
            )
        _positive("update_info", "timeout", self.timeout)


def _copy_held(items: list[tuple[str, torch.Tensor]]) -> None:
    """Replace the tensors that vLLM's layerwise reload keeps of a layer not whole yet,
    where they are views of ``items``, by copies (most layers are whole within a bucket:
    copying only what is held costs far less than copying every bucket)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    storages = {t.untyped_storage().data_ptr() for _, t in items}
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.untyped_storage().data_ptr() in storages
                ):
                    bound.arguments[key] = value.clone()


def _rank() -> tuple[int, int]:
    """This worker's rank and the number of workers (0, 1 outside a vLLM worker, where
    vLLM's world group is not initialized)."""
    from vllm.distributed.parallel_state import get_world_group

    try:
        g = get_world_group()
    except AssertionError:  # vLLM's "world group is not initialized"
        return 0, 1
    return int(g.rank_in_group), int(g.world_size)


class RlferryWeightTransferEngine(WeightTransferEngine):
    """vLLM's weight-transfer engine of the ``rlferry`` backend (worker side).

    ``init_transfer_engine`` joins the trainer's ``WeightSender`` with a
    ``WeightReceiver`` that checks each plan against the checkpoint's shapes (when the
    model is a local safetensors directory) before any bucket moves.
    ``start_weight_update`` sets the model's layers up for reloading (vLLM's layerwise
    reload, as its NCCL backend does: kernels that repack weights, as on the CPU, need
    it); ``update_weights({"version": v, "timeout": s})`` loads the pushed buckets with
    ``model.load_weights`` on the worker's thread and returns once the receiver
    committed ``v``; ``finish_weight_update`` finishes the reload. An update that fails
    raises with the receiver's reason and leaves the model servable (layers loaded whole
    keep the new weights, the others their old ones); vLLM then refuses
    ``finish_weight_update`` until the next ``start_weight_update``. No pickle: the
    RPCs carry JSON-able dicts, the bytes go through rlferry's transports.
    """

    init_info_cls = RlferryInitInfo
    update_info_cls = RlferryUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: WeightReceiver | None = None
        self._gate: Gate | None = None
        self._reloading = False
        self._loaded = 0  # buckets loaded in this update
        self.version: int | None = None  # the version last committed
        self.mixed = False  # the last update failed after loading part of its push
        self.last_error: str | None = None
        self.adapter = PushedAdapter(model)  # a LoRA adapter pushed (vLLM's enable_lora)

    # -- vLLM's calls -----------------------------------------------------------------------
    def init_transfer_engine(self, init_info: RlferryInitInfo) -> None:
        rank, world = _rank()
        name = init_info.name or f"vllm:{socket.gethostname()}:{os.getpid()}"
        if world > 1:
            name = f"{name}:rank{rank}"
        gate = Gate(name, init_info.timeout)
        model_path = str(getattr(self.model_config, "model", "") or "")
        checkpoint = checkpoint_check(model_path)

        def expected(specs: list[TensorSpec]) -> None:
            self.adapter.check(specs)
            if checkpoint is not None:
                checkpoint(specs)

        recv = WeightReceiver(
            group=init_info.group, address=init_info.address, load=gate.load,
            on_commit=gate.committed, on_failure=gate.failed, expected=expected,
            verify=init_info.verify, name=name, secret=init_info.secret,
            device=self.device if torch.device(self.device).type == "cuda" else None,
            # a delta push is applied to a host copy, and load_weights gets every tensor:
            # vLLM's layerwise reload rebuilds a layer from the tensors loaded into it
            deltas="whole",
        )  # fmt: skip
        recv.start(init_info.timeout)
        old, self.receiver, self._gate = self.receiver, recv, gate
        if old is not None:
            old.close()

    def start_weight_update(self) -> None:
        gate = self._required("start_weight_update")
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._reloading, self._loaded = True, 0
        gate.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one push; on the CPU without vLLM's ``torch.accelerator.synchronize()``
        (it raises where no accelerator is)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.device(self.device).type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: RlferryUpdateInfo) -> None:
        gate = self._required("update_weights")
        if not self._reloading:
            raise GateError(
                f"receiver `{gate.name}`: update_weights came outside a weight update "
                "(call start_weight_update first)"
            )
        try:
            self.version = gate.run(update_info.version, update_info.timeout, self._load)
            self.adapter.commit()
        except BaseException as e:
            self.adapter.drop()
            loaded, self.mixed = self._loaded, self._loaded > 0
            self._abandon()
            why = str(e) if isinstance(e, GateError) else f"{type(e).__name__}: {e}"
            if loaded:
                why += (
                    f"; {loaded} buckets were loaded before it: layers they completed hold "
                    "the new weights, the others the old ones, until an update commits whole"
                )
            else:
                why += "; the model keeps its weights"
            self.last_error = why
            if not isinstance(e, Exception):
                raise
            raise GateError(why) from None
        self.mixed, self.last_error = False, None

    def finish_weight_update(self) -> None:
        gate = self._required("finish_weight_update")
        if self._reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)
        gate.finish()

    def shutdown(self) -> None:
        recv, self.receiver = self.receiver, None
        if recv is not None:
            recv.close()

    # -- the rest --------------------------------------------------------------------------
    def _required(self, call: str) -> Gate:
        if self._gate is None:
            raise NotStarted(
                f"{call}: the rlferry backend has not joined a sender (call "
                "init_weight_transfer_engine with {'group': ..., 'address': ...} first)"
            )
        return self._gate

    def _load(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket on this (the worker's) thread, then copy what vLLM still holds
        of it: while reloading, vLLM keeps the tensors of a layer until the layer is
        whole, and the bucket's buffer is reused for a later bucket."""
        try:
            from vllm.model_executor.model_loader.mtp_validation import (
                disable_mtp_completeness_check as unchecked,
            )
        except ImportError:  # pragma: no cover - an older vLLM
            unchecked = contextlib.nullcontext
        items = self.adapter.take(items)  # an adapter's tensors go to vLLM's LoRA manager
        with unchecked():
            if items:
                self.model.load_weights(items)
        if self._reloading:
            _copy_held(items)
        if torch.device(self.device).type == "cuda":
            torch.cuda.current_stream().synchronize()
        self._loaded += 1

    def _abandon(self) -> None:
        """End a failed update so that the model serves: a layer whose weights came in
        part drops them and keeps its old ones; the reload is finished."""
        if not self._reloading:
            return
        self._reloading = False
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        for layer in self.model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load() and info.load_numel > 0:
                info.loaded_weights.clear()
                info.load_numel = 0
        finalize_layerwise_reload(self.model, self.model_config)


class WorkerExtension:
    """A vLLM worker extension (``worker_extension_cls=
    "rlferry.engines.vllm.WorkerExtension"``) for trainers that drive weights with
    ``collective_rpc``, as verl, OpenRLHF and PipelineRL do::

        llm.collective_rpc("rlferry_join", args=("rollout", sender.address))
        # then, for each update (the push on one thread, the RPC on another):
        llm.collective_rpc("rlferry_receive", args=(version, 60.0))  # -> [version, ...]

    Importing it (vLLM does in every worker process) registers the ``rlferry``
    weight-transfer backend there too. The extension's receiver is its own, apart
    from the backend's (``weight_transfer_config``), if both are used.
    """

    def _rlferry_engine(self) -> RlferryWeightTransferEngine:
        """This extension's own backend object (apart from the one vLLM makes for
        ``weight_transfer_config``: both may serve, each its own sender)."""
        w: Any = self
        own = getattr(w, "_rlferry_own_engine", None)
        if own is None:
            from vllm.config.weight_transfer import WeightTransferConfig

            own = RlferryWeightTransferEngine(
                WeightTransferConfig(backend="rlferry"), w.vllm_config, w.device,
                w.model_runner.get_model(),
            )  # fmt: skip
            w._rlferry_own_engine = own
        return own

    def rlferry_join(
        self,
        group: str,
        address: str,
        secret: str | None = None,
        name: str | None = None,
        timeout: float = 30.0,
    ) -> str:
        """Join the trainer's ``WeightSender`` of ``group`` at ``address``; the receiver's
        name (push failures name it)."""
        engine = self._rlferry_engine()
        info = RlferryInitInfo(group=group, address=address, secret=secret, name=name,
                               timeout=timeout)  # fmt: skip
        engine.init_transfer_engine(info)
        assert engine.receiver is not None
        return engine.receiver.name

    def rlferry_receive(self, version: int | None = None, timeout: float = 60.0) -> int:
        """Receive one push (``version``, or None: whichever comes) and serve it: start,
        load on this thread, finish. Returns the version committed.

        Raises:
            GateError: the push failed (the receiver's reason), another version came, or
                none within ``timeout`` s; the model stays servable (see
                :class:`RlferryWeightTransferEngine`).
        """
        from vllm.config import set_current_vllm_config

        engine = self._rlferry_engine()
        info = RlferryUpdateInfo(version=version, timeout=timeout)
        with set_current_vllm_config(engine.vllm_config):
            engine.start_weight_update()
            engine.update_weights({"version": info.version, "timeout": info.timeout})
            engine.finish_weight_update()
        assert engine.version is not None
        return engine.version

    def rlferry_adapter(self) -> bool:
        """Serve the LoRA adapter pushed last again (vLLM drops adapters at the end of a
        weight update; ``VLLMEngine`` calls this after it); whether there is one."""
        engine = self._rlferry_backend()
        if engine is None:
            return False
        engine.adapter.install()
        return engine.adapter.served

    def _rlferry_backend(self) -> RlferryWeightTransferEngine | None:
        """The backend's engine (the extension's own when no backend is configured)."""
        w: Any = self
        engine = getattr(w, "weight_transfer_engine", None)
        if not isinstance(engine, RlferryWeightTransferEngine):
            engine = getattr(w, "_rlferry_own_engine", None)
        return engine

    def rlferry_state(self) -> dict[str, Any]:
        """This worker's weights as the backend's receiver holds them (the extension's
        when no backend is configured): ``version`` (last committed, None before the first),
        ``mixed`` (the last update failed after loading part of its push),
        ``error`` (why the last update failed, None after a success) and ``adapter``
        (a pushed LoRA adapter is served)."""
        engine = self._rlferry_backend()
        if engine is None:
            return {"version": None, "mixed": False, "error": None, "adapter": False}
        return {"version": engine.version, "mixed": engine.mixed, "error": engine.last_error,
                "adapter": engine.adapter.served}  # fmt: skip
