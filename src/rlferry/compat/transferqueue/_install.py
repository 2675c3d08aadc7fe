"""``install()``: make ``import transfer_queue`` (and the submodules frameworks and
TransferQueue's own tests import) resolve to this package."""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["install", "uninstall"]

_MARK = "__rlferry_shim__"


def _names(module: Any, names: list[str]) -> dict[str, Any]:
    return {n: getattr(module, n) for n in names}


DATALOADER = ["StreamingDataLoader", "StreamingDataset", "chunk_batch_fn", "default_fetch_batch_fn"]
"""What ``transfer_queue.dataloader`` and its submodules hold."""

INTERFACE = [
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "attach",
    "close",
    "current_backend",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
    "serve_workers",
    "use_launcher",
]
"""What ``transfer_queue.interface`` holds: TransferQueue's module functions, and the shim's
``use_launcher``, ``current_backend``, ``attach`` and ``serve_workers``."""


def _submodules() -> dict[str, dict[str, Any]]:
    """Module name (under ``transfer_queue.``) -> the names it exposes."""
    from . import _errors, client, metadata, samplers

    sampler = _names(samplers, samplers.__all__)
    dataloader = _names(client, DATALOADER)
    return {
        "metadata": _names(metadata, ["BatchMeta", "extract_field_schema", "KVBatchMeta"]),
        "client": _names(client, ["AsyncTransferQueueClient", "TransferQueueClient"]),
        "interface": _names(client, INTERFACE),
        "sampler": sampler,
        "sampler.base": sampler,
        "sampler.sequential_sampler": sampler,
        "sampler.grpo_group_n_sampler": sampler,
        "sampler.rank_aware_sampler": sampler,
        "sampler.seqlen_balanced_sampler": sampler,
        "dataloader": dataloader,
        "dataloader.streaming_dataset": dataloader,
        "dataloader.streaming_dataloader": dataloader,
        "storage": _names(_errors, ["StorageKeyNotFoundError"]),
    }


def install() -> None:
    """After this, ``import transfer_queue`` gives rlferry's implementation (also its
    submodules ``transfer_queue.metadata``, ``.client``, ``.interface``, ``.sampler.*``,
    ``.dataloader.*``, ``.storage``). Call it before anything imports ``transfer_queue``.

    Raises:
        RuntimeError: the real ``transfer_queue`` was imported already.
    """
    present = sys.modules.get("transfer_queue")
    if present is not None:
        if getattr(present, _MARK, False):
            return
        raise RuntimeError(
            "install(): expected `transfer_queue` not imported yet, got TransferQueue's own "
            f"module ({getattr(present, '__file__', '?')}) already imported (call install() at "
            "start-up, before importing verl or transfer_queue)"
        )
    from . import __all__ as names
    from . import __name__ as package
    from . import __version__

    top = types.ModuleType("transfer_queue", "TransferQueue's API on rlferry (installed shim)")
    source = sys.modules[package]
    top.__dict__.update({n: getattr(source, n) for n in names})
    top.__dict__.update(__version__=__version__, __path__=[], **{_MARK: True})
    made = {"transfer_queue": top}
    for dotted, exposed in _submodules().items():
        name = f"transfer_queue.{dotted}"
        mod = types.ModuleType(name, f"TransferQueue's `{name}` on rlferry (installed shim)")
        mod.__dict__.update(exposed)
        mod.__dict__.update(__path__=[], **{_MARK: True})
        made[name] = mod
    for name, mod in made.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(made[parent], child, mod)
    sys.modules.update(made)


def uninstall() -> None:
    """Undo ``install()``: ``transfer_queue`` imports TransferQueue again (if installed)."""
    for name in [
        n for n in sys.modules if n == "transfer_queue" or n.startswith("transfer_queue.")
    ]:
        if getattr(sys.modules[name], _MARK, False):
            del sys.modules[name]
