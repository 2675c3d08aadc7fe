"""The queue's services, for launchers: the controller and the storage units, served.

An embedded :class:`~rlferry.queue.Queue` runs them in its process, ``rlferry serve
queue`` (:func:`serve_queue`) in processes of its own, ``rlferry.ray`` in actors. A
launcher of its own starts a :class:`StorageService` per unit, then a
:class:`ControllerService` over the units' addresses, then links each unit to the
controller; clients connect to the controller's address.
"""

from .._config import QueueConfig
from ..statistics import ControllerStatistics, StorageStatistics
from ._controller import Controller
from ._launch import UNIT_START_TIMEOUT, ControllerService, StorageService, serve_queue
from ._storage import StorageUnit

__all__ = [
    "UNIT_START_TIMEOUT",
    "Controller",
    "ControllerService",
    "ControllerStatistics",
    "QueueConfig",
    "StorageService",
    "StorageStatistics",
    "StorageUnit",
    "serve_queue",
]
