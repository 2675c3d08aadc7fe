"""The TransferQueue API's state, in the process that holds it: the controller (partitions,
global indexes, production and consumption status, schema, custom meta, keys; waits on
events) and the store (the payload, as the chunks it was put in), and their checkpoint
files (rlferry's checked format, no pickle).

The embedded backend holds them in the caller's process; a service holds them for others.
"""

from ._controller import Controller
from ._saved import CONTROLLER_FILE, PICKLED_CONTROLLER_FILE, PICKLED_STORAGE_FILE, STORAGE_FILE
from ._store import Store
from ._values import objects, pack

__all__ = [
    "CONTROLLER_FILE",
    "PICKLED_CONTROLLER_FILE",
    "PICKLED_STORAGE_FILE",
    "STORAGE_FILE",
    "Controller",
    "Store",
    "objects",
    "pack",
]
