"""The weight plane: stream a trainer's weights to inference engines.

One sender per group of receivers; the bytes move over a transport (``shm``,
``cuda_ipc`` or ``broadcast``), the control messages over the wire::

    sender = WeightSender(group="rollout", transport="shm", receivers=2)
    recv = WeightReceiver(group="rollout", address=sender.address, load=fn).start()
    report = sender.push(model.state_dict().items(), version=7, timeout=60)

``ParamLoader(params)`` is a ready ``load``: each bucket copied into the engine's
tensors by one grouped copy (``rlferry.weights.copies.GroupedCopy``: one Triton
launch on CUDA).

A sender with ``delta_budget`` keeps its last version and pushes only what changed
to receivers that hold it (``WeightReceiver(..., deltas="in_place")``: ``load`` gets
``(name, Delta)`` items, which ``ParamLoader`` applies in place)::

    sender = WeightSender(group="rollout", transport="broadcast", delta_budget=32 << 30)
    report = sender.push(model.state_dict().items(), version=8, dtype=torch.bfloat16)
    report.kind, report.sent_bytes / report.full_bytes  # ("delta", 0.068)

At scale every trainer rank sends what it owns straight to the engine ranks that
need it: a ``ShardedSender`` per trainer rank, a ``ShardedReceiver`` per engine
rank, one plan computed from both layouts (``fsdp_layout`` for the trainer,
``tp_layout`` for a tensor-parallel engine, from the tensors' ``specs_of``)::

    trainer, engine = fsdp_layout(specs, 4), tp_layout(specs, 2, dtype=torch.bfloat16)
    s = ShardedSender(group="g", rank=dist.get_rank(), trainer=trainer, engine=engine)
    r = ShardedReceiver(group="g", rank=tp_rank, trainer=trainer, engine=engine,
                        params=params, addresses=sender_addresses).start()

Rank 0's ``describe_group(addresses)`` lets an engine told only its address find
every rank (``describe_group(group, address)`` on the engine's side).

The planner and the plan primitives (``dtensor_layout``, ``TrainerLayout``,
``EngineLayout``, ``ShardPlan``, ``predict``...) are :mod:`rlferry.weights.planning`'s.
"""

import importlib
import warnings
from typing import Any

from ._errors import (
    PushTimeout,
    ReceiverClosed,
    SenderClosed,
    SenderGone,
    WeightSyncError,
)
from ._fingerprint import fingerprint
from ._report import (
    PushReport,
    ReceiverStatistics,
    SenderStatistics,
    ShardedReceiverStatistics,
    ShardedSenderStatistics,
)
from .copies import ParamLoader
from .planning import fsdp_layout, specs_of, tp_layout
from .receiver import WeightReceiver
from .sender import WeightSender
from .sharded import ShardedReceiver, ShardedSender, describe_group

__all__ = [
    "ParamLoader",
    "PushReport",
    "PushTimeout",
    "ReceiverClosed",
    "ReceiverStatistics",
    "SenderClosed",
    "SenderGone",
    "SenderStatistics",
    "ShardedReceiver",
    "ShardedReceiverStatistics",
    "ShardedSender",
    "ShardedSenderStatistics",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "describe_group",
    "fingerprint",
    "fsdp_layout",
    "specs_of",
    "tp_layout",
]

# names that moved out of rlferry.weights, by their new home: importable from here, with a
# DeprecationWarning, for one release
_MOVED = {
    **dict.fromkeys(
        (
            "Cluster",
            "Copy",
            "EngineLayout",
            "ParamLayout",
            "Part",
            "Piece",
            "Prediction",
            "ShardPlan",
            "TensorSpec",
            "TrainerLayout",
            "dtensor_layout",
            "plan_weights",
            "predict",
        ),
        "rlferry.weights.planning",
    ),
    "GroupedCopy": "rlferry.weights.copies",
    "SenderGroup": "rlferry.weights.sharded",
    "link_group": "rlferry.weights.sharded",
}


def __getattr__(name: str) -> Any:
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'rlferry.weights' has no attribute {name!r}")
    warnings.warn(
        f"rlferry.weights.{name} moved to {home}.{name}: import it from there (the old name "
        "goes in the next release)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(home), name)
