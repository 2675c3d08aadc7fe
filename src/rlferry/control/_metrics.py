"""Prometheus metrics of a coordinator (the optional extra ``[prometheus]``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ._coordinator import Coordinator

__all__ = ["register_metrics"]

_GAUGES = {
    "version": "the trainer's weight version",
    "running": "samples generating now",
    "ready_groups": "finished groups waiting for the trainer",
    "capacity": "samples that may be admitted now (the staleness bound's room)",
    "engines_serving": "engines that get rollouts",
    "waiting_submits": "submit calls waiting for room",
    "staleness_mean": "mean lag of the samples trained, in versions",
    "staleness_max": "largest lag of a sample trained, in versions",
}
_COUNTERS = {
    "accepted": "samples finished and kept",
    "consumed": "samples the trainer took",
    "dropped": "samples dropped (too stale, or of a failed group)",
    "regenerated": "samples generated again after being too stale",
    "updates": "weight updates",
    "pause_seconds": "seconds engines took to pause, over all updates",
    "push_seconds": "seconds of weight pushes, over all updates",
    "update_seconds": "seconds of whole updates (pause or push, to the last resume)",
}


def register_metrics(
    coordinator: Coordinator, registry: Any = None, prefix: str = "rlferry"
) -> Any:
    """Expose ``coordinator.statistics()`` as Prometheus metrics (read at each scrape: no
    thread, no poll); returns the collector. ``registry`` defaults to prometheus_client's.

    Raises:
        ImportError: prometheus-client is not installed (``pip install 'rlferry[prometheus]'``).
    """
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError:
        raise ImportError(
            "register_metrics needs prometheus-client: pip install 'rlferry[prometheus]'"
        ) from None

    class Collector:
        def collect(self) -> Iterator[Any]:
            stats = coordinator.statistics()
            for name, doc in _GAUGES.items():
                yield GaugeMetricFamily(f"{prefix}_{name}", doc, value=getattr(stats, name))
            for name, doc in _COUNTERS.items():
                yield CounterMetricFamily(f"{prefix}_{name}", doc, value=getattr(stats, name))

    collector = Collector()
    (registry or REGISTRY).register(collector)
    return collector
