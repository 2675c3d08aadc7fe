"""Placement groups that fail fast: Ray alone waits forever for one that cannot fit, with
only an autoscaler log line to say why. Here a group not ready within ``ready_timeout``
is removed and raises :class:`LaunchError` naming the bundles asked and each node's free
resources."""

from __future__ import annotations

from typing import Any

from rlferry.errors import RequestError

from ._common import LaunchError, ray

__all__ = ["READY_TIMEOUT", "STOP_TIMEOUT", "Placed", "free_resources", "place", "stop_all"]

READY_TIMEOUT = 60.0
"""Seconds a placement group may take to be ready (the default ``ready_timeout``)."""
STOP_TIMEOUT = 10.0
"""Seconds a job's actors may take to close their services, and then to die."""


def free_resources() -> dict[str, dict[str, float]]:
    """Free resources per alive node, by ``ADDRESS/NODE_ID[:8]`` (``CPU``, ``GPU``, memory
    in GiB, any custom resource; Ray's ``node:`` markers and object store left out)."""
    r = ray()
    try:  # per node, free now (Ray has no public call for it without its dashboard)
        free = r._private.state.available_resources_per_node()
    except AttributeError:
        free = {}
    out: dict[str, dict[str, float]] = {}
    for node in r.nodes():
        if not node.get("Alive"):
            continue
        have = free.get(node["NodeID"], node.get("Resources", {}))
        shown = {}
        for key, value in sorted(have.items()):
            if key.startswith("node:") or key == "object_store_memory":
                continue
            shown[key] = round(value / 2**30, 1) if key == "memory" else value
        out[f"{node['NodeManagerAddress']}/{node['NodeID'][:8]}"] = shown
    return out


def _bundles_text(bundles: list[dict[str, float]]) -> str:
    return "[" + ", ".join("{" + ", ".join(f"{k}: {v:g}" for k, v in b.items()) + "}"
                           for b in bundles) + "]"  # fmt: skip


def place(
    bundles: list[dict[str, float]], strategy: str, *, name: str, what: str,
    ready_timeout: float,
) -> Any:  # fmt: skip
    """A ready placement group ``name`` of ``bundles`` (``strategy``: ``PACK``, ``SPREAD``,
    ``STRICT_PACK``, ``STRICT_SPREAD``); ``what`` names it in errors.

    Raises:
        LaunchError: not ready within ``ready_timeout`` seconds (it is removed): the
            message names the bundles and each node's free resources.
    """
    if type(ready_timeout) not in (int, float) or not ready_timeout > 0:
        raise RequestError(f"ready_timeout: expected seconds > 0, got {ready_timeout!r}")
    r = ray()
    pg = r.util.placement_group(bundles, strategy=strategy, name=name)
    try:
        r.get(pg.ready(), timeout=ready_timeout)
    except r.exceptions.GetTimeoutError:
        r.util.remove_placement_group(pg)
        nodes = "; ".join(
            f"{node}: " + ", ".join(f"{k} {v:g}" for k, v in free.items())
            for node, free in free_resources().items()
        )
        raise LaunchError(
            f"{what}: Ray could not place {len(bundles)} bundles "
            f"{_bundles_text(bundles)} ({strategy}) within {ready_timeout:g} s; free per "
            f"node: {nodes} (ask for fewer or smaller bundles, or add nodes)"
        ) from None
    except BaseException:
        r.util.remove_placement_group(pg)
        raise
    return pg


def stop_all(actors: list[Any], pg: Any) -> None:
    """Kill ``actors`` and remove ``pg`` (None: a group they do not own); returns once Ray
    reports each actor dead (their names are free again), at most ``STOP_TIMEOUT`` seconds."""
    r = ray()
    for a in actors:
        r.kill(a)
    ends = [a.until_closed.remote() for a in actors]  # fails at once for a dead actor
    r.wait(ends, num_returns=len(ends), timeout=STOP_TIMEOUT)
    if pg is not None:
        r.util.remove_placement_group(pg)


class Placed:
    """A job's actors in one placement group (``names`` and ``actors`` in the same order);
    :meth:`_stop` has each close its services, then removes them all."""

    def __init__(self, names: list[str], actors: list[Any], pg: Any) -> None:
        self.names = names
        self._actors = actors
        self._pg = pg

    @property
    def actors(self) -> dict[str, Any]:
        """The actors by name."""
        return dict(zip(self.names, self._actors, strict=True))

    @property
    def placement_group(self) -> Any:
        return self._pg

    def _stop(self) -> None:
        if not self._actors:
            return
        stops = [a.close.remote() for a in self._actors]
        ray().wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT)  # dead ones: as is
        stop_all(self._actors, self._pg)
        self._actors.clear()
