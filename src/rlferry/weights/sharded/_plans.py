"""What both ends of a sharded update share: the plan of the current layouts (computed
only when a fingerprint changes), each link's group name, and the check of a rank."""

from __future__ import annotations

import threading
from typing import Any

from rlferry.errors import RequestError

from ..planning._layouts import EngineLayout, TrainerLayout
from ..planning._shard_plan import ShardPlan

__all__ = ["Plans", "check_rank", "link_group"]


def link_group(group: str, rank: int, receiver: int | None = None) -> str:
    """The group name of trainer rank ``rank``'s link (point to point: its link to engine
    rank ``receiver``): receivers join it by this name."""
    link = f"{group}/trainer{rank}"
    return link if receiver is None else f"{link}/engine{receiver}"


def check_rank(owner: str, rank: Any, n: int, what: str) -> int:
    """``rank`` if it is one of the ``n`` ranks of the ``what`` layout, else a RequestError
    naming ``owner``'s argument."""
    if type(rank) is not int or not 0 <= rank < n:
        raise RequestError(
            f"{owner}.rank: expected an int in [0, {n}) (the {what} layout has {n}), got {rank!r}"
        )
    return rank


class Plans:
    """The plan for the current layouts, computed only when a fingerprint changes."""

    def __init__(self, trainer: TrainerLayout, engine: EngineLayout) -> None:
        self.trainer, self.engine = trainer, engine
        self.computed = 0
        self._plan: ShardPlan | None = None
        self._lock = threading.Lock()  # links' threads ask for it too

    def set(self, trainer: TrainerLayout | None, engine: EngineLayout | None) -> None:
        with self._lock:
            self.trainer = trainer or self.trainer
            self.engine = engine or self.engine

    def get(self) -> ShardPlan:
        with self._lock:
            p = self._plan
            if (
                p is None
                or p.trainer.fingerprint != self.trainer.fingerprint
                or p.engine.fingerprint != self.engine.fingerprint
            ):
                p = self._plan = ShardPlan.build(self.trainer, self.engine)
                self.computed += 1
            return p
