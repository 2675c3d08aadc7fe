"""Where the TransferQueue API's state lives: a controller and a store.

``Backend`` is the seam. ``embedded(conf)`` builds both in this process (the
default: no Ray, no cluster, nothing to start). A launcher that runs them as
services (rlferry's Ray launcher) registers a factory with
``use_launcher(factory)``: ``init(conf)`` then calls ``factory(conf)`` and the
client talks to whatever controller and store objects it returns (same methods
as ``Controller`` and ``Store``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._controller import Controller
from ._samplers import BaseSampler
from ._store import Store

__all__ = ["Backend", "embedded"]


@dataclass
class Backend:
    controller: Controller
    store: Store
    conf: Any = None
    pid: int = field(default_factory=os.getpid)
    """The process that built it: an embedded backend lives in that process's memory."""


Factory = Callable[[Any], Backend]


def embedded(conf: Any, sampler: BaseSampler) -> Backend:
    """The controller and the store in this process."""
    ctl = conf.controller
    return Backend(
        Controller(
            sampler=sampler,
            polling_mode=bool(ctl.polling_mode),
            timeout=float(ctl.get_meta_timeout),
            pre_alloc=int(os.environ.get("TQ_PRE_ALLOC_SAMPLE_NUM", "1")),
        ),
        Store(),
        conf,
    )
