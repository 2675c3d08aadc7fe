"""The weight plane: stream a trainer's weights to inference engines.

One sender per group of receivers; the bytes move over a transport (``shm``,
``cuda_ipc`` or ``broadcast``), the control messages over the wire::

    sender = WeightSender(group="rollout", transport="shm", receivers=2)
    recv = WeightReceiver(group="rollout", address=sender.address, load=fn).start()
    report = sender.push(model.state_dict().items(), version=7, timeout=60)

``ParamLoader(params)`` is a ready ``load``: each bucket copied into the engine's
tensors by one grouped copy (``GroupedCopy``: one Triton launch on CUDA).

At scale every trainer rank sends what it owns straight to the engine ranks that
need it: a ``ShardedSender`` per trainer rank, a ``ShardedReceiver`` per engine
rank, one ``ShardPlan`` computed from both layouts (``fsdp_layout`` /
``dtensor_layout`` for the trainer, ``tp_layout`` for a tensor-parallel engine)::

    trainer, engine = fsdp_layout(specs, 4), tp_layout(specs, 2, dtype=torch.bfloat16)
    s = ShardedSender(group="g", rank=dist.get_rank(), trainer=trainer, engine=engine)
    r = ShardedReceiver(group="g", rank=tp_rank, trainer=trainer, engine=engine,
                        params=params, addresses=sender_addresses).start()

Rank 0's ``describe_group(addresses)`` lets an engine told only its address find
every rank (``describe_group(group, address)`` on the engine's side).
"""

from ._errors import PushTimeout, ReceiverClosed, SenderClosed, SenderGone, WeightSyncError
from ._fingerprint import fingerprint
from ._report import (
    PushReport,
    ReceiverStatistics,
    SenderStatistics,
    ShardedReceiverStatistics,
    ShardedSenderStatistics,
)
from .copies._copy import GroupedCopy, ParamLoader
from .planning import (
    Cluster,
    Copy,
    EngineLayout,
    ParamLayout,
    Part,
    Piece,
    Prediction,
    ShardPlan,
    TensorSpec,
    TrainerLayout,
    dtensor_layout,
    fsdp_layout,
    plan_weights,
    predict,
    specs_of,
    tp_layout,
)
from .receiver import WeightReceiver
from .sender import WeightSender
from .sharded import SenderGroup, ShardedReceiver, ShardedSender, describe_group, link_group

__all__ = [
    "Cluster",
    "Copy",
    "EngineLayout",
    "GroupedCopy",
    "ParamLayout",
    "ParamLoader",
    "Part",
    "Piece",
    "Prediction",
    "PushReport",
    "PushTimeout",
    "ReceiverClosed",
    "ReceiverStatistics",
    "SenderClosed",
    "SenderGone",
    "SenderGroup",
    "SenderStatistics",
    "ShardPlan",
    "ShardedReceiver",
    "ShardedReceiverStatistics",
    "ShardedSender",
    "ShardedSenderStatistics",
    "TensorSpec",
    "TrainerLayout",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "describe_group",
    "dtensor_layout",
    "fingerprint",
    "fsdp_layout",
    "link_group",
    "plan_weights",
    "predict",
    "specs_of",
    "tp_layout",
]
