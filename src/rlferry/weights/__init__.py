"""The weight plane: stream a trainer's weights to inference engines.

One sender per group of receivers; the bytes move over a transport (``shm``,
``cuda_ipc`` or ``broadcast``), the control messages over the wire::

    sender = WeightSender(group="rollout", transport="shm", receivers=2)
    recv = WeightReceiver(group="rollout", address=sender.address, load=fn).start()
    report = sender.push(model.state_dict().items(), version=7, timeout=60)

``ParamLoader(params)`` is a ready ``load``: each bucket copied into the engine's
tensors by one grouped copy (``GroupedCopy``: one Triton launch on CUDA).
"""

from ._copy import GroupedCopy, ParamLoader
from ._errors import PushTimeout, ReceiverClosed, SenderClosed, SenderGone, WeightSyncError
from ._fingerprint import fingerprint
from ._plan import TensorSpec
from ._receiver import WeightReceiver
from ._report import PushReport, ReceiverStatistics, SenderStatistics
from ._sender import WeightSender

__all__ = [
    "GroupedCopy",
    "ParamLoader",
    "PushReport",
    "PushTimeout",
    "ReceiverClosed",
    "ReceiverStatistics",
    "SenderClosed",
    "SenderGone",
    "SenderStatistics",
    "TensorSpec",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "fingerprint",
]
