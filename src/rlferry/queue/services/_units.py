"""The storage units as the controller sees them: where each is, how many samples it
holds, whether its connection is up, and the drops it is told to make."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from rlferry.wire import AsyncClient

from .._messages import Drop, to_wire

__all__ = ["Units"]

log = logging.getLogger("rlferry.queue")

_DROP_TIMEOUT = 30.0


class Units:
    """The controller's storage units, by number: ``addresses``, ``load`` (samples held
    on each), ``up`` (False once its connection is lost: puts avoid it)."""

    def __init__(self, addresses: list[str], secret: str | bytes | None) -> None:
        self.addresses = list(addresses)
        self.load = [0] * len(addresses)
        self.up = [True] * len(addresses)
        self._secret = secret
        self._clients: list[AsyncClient] = []
        self._bg: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self.addresses)

    def register(self, address: str) -> int:
        """A unit of this process, bound at ``address``; its number."""
        self.addresses.append(address)
        self.load.append(0)
        self.up.append(True)
        return len(self.addresses) - 1

    def watch(self) -> None:
        """Connect to every unit now: their connections report up and down from then on."""
        for unit in range(len(self.addresses)):
            self._client(unit).connect()

    def alive(self) -> list[int]:
        return [u for u in range(len(self.addresses)) if self.up[u]]

    def _client(self, unit: int) -> AsyncClient:
        while len(self._clients) <= unit:
            u = len(self._clients)
            state = functools.partial(self._state, u)
            self._clients.append(
                AsyncClient(self.addresses[u], secret=self._secret, on_state=state)
            )
        return self._clients[unit]

    def _state(self, unit: int, up: bool) -> None:
        if self.up[unit] != up:
            state = "back" if up else "gone"
            log.warning("storage unit %d (%s) is %s", unit, self.addresses[unit], state)
        self.up[unit] = up

    def drop(self, by_unit: dict[int, list[int]]) -> None:
        """Tell each unit to drop the payload of these samples (in the background)."""
        for unit, indexes in by_unit.items():
            self.load[unit] -= len(indexes)
            if not self.up[unit]:
                continue  # its memory went with it
            req = self._client(unit).request(to_wire(Drop(indexes)), timeout=_DROP_TIMEOUT)
            task = asyncio.ensure_future(req)
            self._bg.add(task)
            task.add_done_callback(functools.partial(self._dropped, unit, len(indexes)))

    def _dropped(self, unit: int, count: int, task: asyncio.Task[Any]) -> None:
        self._bg.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "storage unit %d (%s) did not drop %d freed samples: %s (its memory stays "
                "held until it restarts)", unit, self.addresses[unit], count, task.exception(),
            )  # fmt: skip

    async def aclose(self) -> None:
        for c in self._clients:
            await c.aclose()
