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


def _submodules() -> dict[str, dict[str, Any]]:
    """Module name (under ``transfer_queue.``) -> the names it exposes."""
    from . import _client, _dataset, _errors, _interface, _kvmeta, _meta, _samplers

    samplers = _names(_samplers, _samplers.__all__)
    dataset = _names(_dataset, _dataset.__all__)
    return {
        "metadata": {
            **_names(_meta, ["BatchMeta", "extract_field_schema"]),
            "KVBatchMeta": _kvmeta.KVBatchMeta,
        },
        "client": _names(_client, _client.__all__),
        "interface": _names(_interface, _interface.__all__),
        "sampler": samplers,
        "sampler.base": samplers,
        "sampler.sequential_sampler": samplers,
        "sampler.grpo_group_n_sampler": samplers,
        "sampler.rank_aware_sampler": samplers,
        "sampler.seqlen_balanced_sampler": samplers,
        "dataloader": dataset,
        "dataloader.streaming_dataset": dataset,
        "dataloader.streaming_dataloader": dataset,
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
