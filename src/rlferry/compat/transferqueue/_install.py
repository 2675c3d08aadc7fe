"""``install()``: make ``import transfer_queue`` (and the submodules frameworks and
TransferQueue's own tests import) resolve to this package."""

from __future__ import annotations

import importlib.machinery
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


TOP = [
    "init",
    "close",
    "get_metrics_endpoint",
    "kv_put",
    "kv_batch_put",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_list",
    "kv_clear",
    "async_kv_put",
    "async_kv_batch_put",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_list",
    "async_kv_clear",
    "KVBatchMeta",
    "save_checkpoint",
    "load_checkpoint",
    "StreamingDataset",
    "StreamingDataLoader",
    "get_client",
    "BatchMeta",
    "TransferQueueClient",
    "StorageKeyNotFoundError",
    "BaseSampler",
    "GRPOGroupNSampler",
    "SequentialSampler",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
]
"""``transfer_queue.__all__``: TransferQueue 0.1.11's, in its order."""

EXPORTS = {
    "sampler": [
        "BaseSampler",
        "SequentialSampler",
        "GRPOGroupNSampler",
        "RankAwareSampler",
        "SeqlenBalancedSampler",
    ],
    "dataloader": ["StreamingDataset", "StreamingDataLoader"],
    "storage": ["StorageKeyNotFoundError"],
}
"""The ``__all__`` of the submodules that have one in TransferQueue 0.1.11 (its
``transfer_queue.storage`` also lists its storage classes, which the shim does not have)."""


def _module(name: str, doc: str, source: Any, names: dict[str, Any]) -> types.ModuleType:
    """A package module ``name`` holding ``names``, whose ``__file__`` is ``source``'s."""
    mod = types.ModuleType(name, doc)
    mod.__dict__.update(names)
    origin = source.__file__
    spec = importlib.machinery.ModuleSpec(name, None, origin=origin, is_package=True)
    spec.has_location = True
    mod.__dict__.update(
        __file__=origin, __spec__=spec, __package__=name, __path__=[], **{_MARK: True}
    )
    exported = TOP if name == "transfer_queue" else EXPORTS.get(name.partition(".")[2])
    if exported is not None:
        mod.__dict__["__all__"] = list(exported)
    return mod


def _submodules() -> dict[str, tuple[Any, dict[str, Any]]]:
    """Module name (under ``transfer_queue.``) -> the module that implements it and the
    names it exposes."""
    from . import _errors, client, metadata, samplers

    sampler = (samplers, _names(samplers, samplers.__all__))
    dataloader = (client, _names(client, DATALOADER))
    return {
        "metadata": (
            metadata,
            _names(metadata, ["BatchMeta", "extract_field_schema", "KVBatchMeta"]),
        ),
        "client": (client, _names(client, ["AsyncTransferQueueClient", "TransferQueueClient"])),
        "interface": (client, _names(client, INTERFACE)),
        "sampler": sampler,
        "sampler.base": sampler,
        "sampler.sequential_sampler": sampler,
        "sampler.grpo_group_n_sampler": sampler,
        "sampler.rank_aware_sampler": sampler,
        "sampler.seqlen_balanced_sampler": sampler,
        "dataloader": dataloader,
        "dataloader.streaming_dataset": dataloader,
        "dataloader.streaming_dataloader": dataloader,
        "storage": (_errors, _names(_errors, ["StorageKeyNotFoundError"])),
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
    from rlferry import __version__ as rlferry_version

    from . import __all__ as names
    from . import __name__ as package
    from . import __version__

    source = sys.modules[package]
    exposed = {n: getattr(source, n) for n in names}
    exposed.update(__version__=__version__, __rlferry_version__=rlferry_version)
    doc = "TransferQueue's API on rlferry (installed shim)"
    made = {"transfer_queue": _module("transfer_queue", doc, source, exposed)}
    for dotted, (impl, names_of) in _submodules().items():
        name = f"transfer_queue.{dotted}"
        doc = f"TransferQueue's `{name}` on rlferry (installed shim)"
        made[name] = _module(name, doc, impl, names_of)
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
