"""TransferQueue's configuration (``init(conf)``): its keys, merged and checked.

Every key of TransferQueue 0.1.11's configuration is recognised. The ones that
mean something here are used; the ones that name other storage backends are
accepted at their defaults; a key TransferQueue does not have, or a setting the
embedded backend cannot honour, is refused naming the dotted key and the fix.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["merged_config"]

log = logging.getLogger("rlferry.compat.transferqueue")

GET_META_TIMEOUT = 5.0
"""Seconds a fetch ``get_meta`` waits for data (TransferQueue's controller gives up after one
5 s check interval; its environment variables TQ_CONTROLLER_GET_METADATA_TIMEOUT and
TQ_CONTROLLER_GET_METADATA_CHECK_INTERVAL are not read: set ``controller.get_meta_timeout``)."""

_ANY = object()  # a subtree whose keys are not checked (other backends' settings)

DEFAULTS: dict[str, Any] = {
    "metrics": {"enabled": False, "port": 0},
    "controller": {
        "sampler": "SequentialSampler",
        "polling_mode": False,
        "zmq_info": None,
        "get_meta_timeout": GET_META_TIMEOUT,  # rlferry's: seconds a fetch waits
    },
    "backend": {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {
            "total_storage_size": None,
            "num_data_storage_units": 2,
            "required_node_resource": None,
            "zmq_info": None,
            "ssd_offload": {
                "enabled": False,
                "path": None,
                "threshold_bytes": 1048576,
                "glibc_mmap_threshold_bytes": 1048576,
            },
        },
        "MooncakeStore": _ANY,
        "Yuanrong": _ANY,
        "RayStore": _ANY,
    },
}


def _check_keys(given: Any, schema: Any, path: str) -> None:
    if schema is _ANY or not isinstance(schema, dict):
        return
    if not hasattr(given, "items"):
        raise ValueError(
            f"config `{path or '<root>'}`: expected a mapping, got {type(given).__name__}"
        )
    for key, value in given.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in schema:
            known = ", ".join(sorted(schema))
            raise ValueError(
                f"config `{dotted}`: expected one of TransferQueue's keys ({known}), got an "
                "unknown key (a misspelling? rlferry's shim reads TransferQueue 0.1.11's keys)"
            )
        _check_keys(value, schema[key], dotted)


def _plain(schema: Any) -> Any:
    if schema is _ANY:
        return {}
    if isinstance(schema, dict):
        return {k: _plain(v) for k, v in schema.items()}
    return schema


def merged_config(conf: Any) -> Any:
    """TransferQueue's defaults with ``conf`` (OmegaConf or dict) merged in, checked.

    Raises:
        ValueError: an unknown key, or a setting the embedded backend cannot honour.
    """
    try:
        from omegaconf import OmegaConf
    except ImportError:
        raise ImportError(
            "rlferry.compat.transferqueue needs omegaconf and tensordict: pip install 'rlferry[tq]'"
        ) from None
    user = conf if conf is not None else {}
    if OmegaConf.is_config(user):
        user = OmegaConf.to_container(user, resolve=True)
    _check_keys(user, DEFAULTS, "")
    final = OmegaConf.create(_plain(DEFAULTS), flags={"allow_objects": True})
    final = OmegaConf.merge(final, OmegaConf.create(user, flags={"allow_objects": True}))
    backend = final.backend.storage_backend
    if backend != "SimpleStorage":
        raise ValueError(
            f"config `backend.storage_backend`: expected 'SimpleStorage', got {backend!r} "
            "(rlferry keeps the data in its own store; Mooncake and Yuanrong are not supported)"
        )
    if final.backend.SimpleStorage.ssd_offload.enabled:
        raise ValueError(
            "config `backend.SimpleStorage.ssd_offload.enabled`: expected false, got true "
            "(SSD offload is not supported by rlferry's shim: the data stays in memory)"
        )
    if final.metrics.enabled:
        raise ValueError(
            "config `metrics.enabled`: expected false, got true (the shim has no Prometheus "
            "exporter: leave metrics off)"
        )
    timeout = final.controller.get_meta_timeout
    if not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(
            f"config `controller.get_meta_timeout`: expected seconds >= 0, got {timeout!r}"
        )
    size = final.backend.SimpleStorage.total_storage_size
    units = final.backend.SimpleStorage.num_data_storage_units
    if size is not None or units != 2:
        log.info(
            "config backend.SimpleStorage (total_storage_size=%s, num_data_storage_units=%s): "
            "the embedded store holds every sample in this process; these are not used",
            size,
            units,
        )
    return final
