"""Checkpoints of the TransferQueue API's state: a directory with the controller's state, the
data and the caller's metadata, replaced only once a new one is whole.

The state files are written and read by whoever holds the state (this process, or the
queue's service on its host) at the paths given, in rlferry's checked format
(:mod:`rlferry.wire.files`): nothing is pickled, and a file that is truncated or changed is
refused, naming it. A checkpoint TransferQueue itself wrote (``torch.save`` pickles) is read
only with ``load_checkpoint(dir, trust_pickle=True)``: unpickling can run code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlferry.wire.files import new_directory, whole_directory

from ..state import CONTROLLER_FILE, PICKLED_CONTROLLER_FILE
from ._client import TransferQueueClient
from ._process import HERE

__all__ = ["load_checkpoint", "save_checkpoint"]

_METADATA_FILE = "metadata.json"


def _save(client: TransferQueueClient, target: Path, metadata: dict[str, Any] | None) -> None:
    with new_directory(target, replaces=_METADATA_FILE) as tmp:
        client.save_controller_checkpoint(str(tmp / CONTROLLER_FILE))
        client.save_storage_checkpoint(str(tmp))
        with open(tmp / _METADATA_FILE, "w") as f:
            json.dump({"storage_saved": True, "user_metadata": metadata or {}}, f, indent=2)


def _load(client: TransferQueueClient, target: Path, trust_pickle: bool) -> None:
    found = whole_directory(target)  # a save that died between its two renames: the old one
    if not (found / _METADATA_FILE).exists():
        raise FileNotFoundError(f"{_METADATA_FILE} not found in {found}")
    controller = found / CONTROLLER_FILE
    if not controller.exists() and (found / PICKLED_CONTROLLER_FILE).exists():
        controller = found / PICKLED_CONTROLLER_FILE  # TransferQueue's own
    if not controller.exists():
        raise FileNotFoundError(f"{CONTROLLER_FILE} not found in {found}")
    with open(found / _METADATA_FILE) as f:
        saved = json.load(f)
    if saved.get("storage_saved"):
        client.load_storage_checkpoint(str(found), trust_pickle=trust_pickle)
    client.load_controller_checkpoint(str(controller), trust_pickle=trust_pickle)


def save_checkpoint(
    checkpoint_dir: str | Path,
    *,
    include_storage: bool = True,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write the whole state (controller, and the data: it lives in memory, so always) to
    ``checkpoint_dir``, replacing an earlier checkpoint there only once the new one is whole
    (a directory of other files there is never replaced: ``FileExistsError``).
    Nothing is pickled: a value the wire does not carry (rlferry.wire.encode) is refused.

    Raises:
        RuntimeError: not initialized. WireError: a value that cannot be written, naming it.
    """
    if HERE.client is None:
        raise RuntimeError("TransferQueue is not initialized. Call tq.init() first.")
    _save(HERE.client, Path(checkpoint_dir), metadata)


def load_checkpoint(checkpoint_dir: str | Path, *, trust_pickle: bool = False) -> None:
    """Restore the state ``save_checkpoint`` wrote. ``trust_pickle``: also read a checkpoint
    in TransferQueue's own format (``torch.save`` pickles, which can run code when loaded:
    only for files you trust); without it such a file is refused.

    Raises:
        FileNotFoundError: no checkpoint there. RuntimeError: not initialized.
        FileFormatError: a file of it is not whole (truncated, changed, another format), or
            a pickle without ``trust_pickle``; the message names the file.
    """
    if HERE.client is None:
        raise RuntimeError("TransferQueue is not initialized. Call tq.init() first.")
    _load(HERE.client, Path(checkpoint_dir), trust_pickle)
