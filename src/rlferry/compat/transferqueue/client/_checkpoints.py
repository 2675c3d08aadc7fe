"""Checkpoints of the TransferQueue API's state: a directory with the controller's state, the
data and the caller's metadata, replaced only once a new one is whole.

The state files are written and read by whoever holds the state (this process, or the
queue's service on its host) at the paths given; loading unpickles them (the controller's
state holds the shim's own objects), so load only checkpoints you wrote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ._client import TransferQueueClient
from ._process import HERE

__all__ = ["load_checkpoint", "save_checkpoint"]

_METADATA_FILE = "metadata.json"
_CONTROLLER_FILE = "controller_state.pt"


def _save(client: TransferQueueClient, target: Path, metadata: dict[str, Any] | None) -> None:
    tmp = target.parent / f"{target.name}.tmp"
    old = target.parent / f"{target.name}.old"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        client.save_controller_checkpoint(str(tmp / _CONTROLLER_FILE))
        client.save_storage_checkpoint(str(tmp))
        with open(tmp / _METADATA_FILE, "w") as f:
            json.dump({"storage_saved": True, "user_metadata": metadata or {}}, f, indent=2)
        if target.exists():
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
        tmp.rename(target)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(tmp)
        if old.exists() and not target.exists():
            old.rename(target)
        raise


def _load(client: TransferQueueClient, target: Path) -> None:
    old = target.parent / f"{target.name}.old"
    if not target.exists() and old.exists():
        old.rename(target)  # a save died between its two renames: the old one is whole
    if not target.exists():
        raise FileNotFoundError(f"Checkpoint directory not found: {target}")
    for name in (_METADATA_FILE, _CONTROLLER_FILE):
        if not (target / name).exists():
            raise FileNotFoundError(f"{name} not found in {target}")
    with open(target / _METADATA_FILE) as f:
        saved = json.load(f)
    if saved.get("storage_saved"):
        client.load_storage_checkpoint(str(target))
    client.load_controller_checkpoint(str(target / _CONTROLLER_FILE))


def save_checkpoint(
    checkpoint_dir: str | Path,
    *,
    include_storage: bool = True,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write the whole state (controller, and the data: it lives in memory, so always) to
    ``checkpoint_dir``, replacing an earlier checkpoint there only once the new one is whole.

    Raises:
        RuntimeError: not initialized.
    """
    if HERE.client is None:
        raise RuntimeError("TransferQueue is not initialized. Call tq.init() first.")
    _save(HERE.client, Path(checkpoint_dir), metadata)


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Restore the state ``save_checkpoint`` wrote (a checkpoint is trusted: it is unpickled).

    Raises:
        FileNotFoundError: no checkpoint there. RuntimeError: not initialized.
    """
    if HERE.client is None:
        raise RuntimeError("TransferQueue is not initialized. Call tq.init() first.")
    _load(HERE.client, Path(checkpoint_dir))
