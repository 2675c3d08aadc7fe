"""TransferQueue's module functions that start, reach and stop the system: ``init``,
``close``, ``get_client``, ``get_metrics_endpoint`` (and the shim's ``use_launcher``)."""

from __future__ import annotations

import os
import sys
from typing import Any

from .. import samplers
from .._config import merged_config
from .._errors import NotInitialized
from ..backends import embedded
from ._client import TransferQueueClient
from ._process import HERE, current_backend, drop, ended

__all__ = ["api_client", "close", "get_client", "get_metrics_endpoint", "init"]


def _sampler(spec: Any) -> samplers.BaseSampler:
    if isinstance(spec, samplers.BaseSampler):
        return spec
    if isinstance(spec, type) and issubclass(spec, samplers.BaseSampler):
        return spec()
    names = [n for n in samplers.__all__ if n.endswith("Sampler") and n != "BaseSampler"]
    if isinstance(spec, str) and spec in names:
        made: samplers.BaseSampler = getattr(samplers, spec)()
        return made
    raise ValueError(
        f"Could not find sampler {spec!r}: expected one of {names}, a BaseSampler subclass or "
        "an instance (config `controller.sampler`)"
    )


def _on_ray(final: Any) -> bool:
    """Ray is running in this process, or the configuration names a Ray node resource for
    the storage (``backend.SimpleStorage.required_node_resource``)."""
    if final.backend.SimpleStorage.required_node_resource is not None:
        return True
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def _new_client() -> TransferQueueClient:
    return TransferQueueClient(client_id=f"TransferQueueClient_{os.getpid()}")


def init(conf: Any = None) -> Any:
    """Start the TransferQueue system, or connect to the one the job runs.

    Embedded in this process by default. When Ray is initialised (or ``conf`` names
    ``backend.SimpleStorage.required_node_resource``), the queue's state is a named Ray
    actor of the job: the first ``init`` starts it, ``init`` in any other task or actor
    of the job connects to it (``conf`` is then not used, as in TransferQueue). With a
    launcher registered by ``use_launcher``, its factory builds the backend. A second
    call reuses what the first made and returns ``conf`` as given.

    Returns:
        The merged configuration (an OmegaConf ``DictConfig``).

    Raises:
        ValueError: an unknown configuration key or an unsupported setting.
    """
    if HERE.backend is not None and HERE.backend.pid == os.getpid():
        if not ended(HERE.backend):
            return conf
        drop()
    if HERE.inherited is not None:
        current_backend()
        HERE.client = _new_client()
        return conf
    final = merged_config(conf)
    sampler = _sampler(final.controller.sampler)
    if HERE.launcher is not None:
        HERE.backend = HERE.launcher(final)
    elif _on_ray(final):
        from ..backends import _ray

        HERE.backend = _ray.start(final, sampler)
    else:
        HERE.backend = embedded(final, sampler)
    HERE.client = _new_client()
    return final


def close() -> None:
    """Drop the system: the client, and in the process that started it the queue's state
    (every sample; on Ray the service actor). Elsewhere only this process's connection."""
    if HERE.client is not None:
        HERE.client.close()
    backend, HERE.client, HERE.backend = HERE.backend, None, None
    if backend is not None and backend.pid == os.getpid():
        backend.close()


def get_client() -> TransferQueueClient:
    """The client ``init()`` made, for TransferQueue's low-level API (in a Ray worker of a
    job that runs the queue on Ray, one connected to it)."""
    try:
        return api_client()
    except NotInitialized:
        raise NotInitialized(
            "Please initialize the TransferQueue first by calling `tq.init()`: expected an "
            "initialized system, got none"
        ) from None


def get_metrics_endpoint() -> str | None:
    """Always None: the shim has no Prometheus exporter (``metrics.enabled`` is refused)."""
    return None


def api_client() -> TransferQueueClient:
    """The module API's client, made where this process can reach a running queue.

    Raises:
        NotInitialized: no queue this process can reach.
    """
    backend = HERE.backend
    if HERE.client is None or backend is None or backend.pid != os.getpid() or ended(backend):
        current_backend()  # connects where the process can reach a running queue
        HERE.client = _new_client()
    return HERE.client
