"""The client's argument checks, with the exception types TransferQueue's client raises."""

from __future__ import annotations

from itertools import repeat
from typing import Any

__all__ = ["check_get", "index_list", "key_list"]


def check_get(data_fields: Any, batch_size: Any, mode: str, task_name: Any) -> None:
    """Arguments TransferQueue's controller refuses: a ``RuntimeError``, as its client
    reports every controller error."""
    if mode not in ("fetch", "force_fetch", "insert"):
        raise RuntimeError(
            f"mode: expected 'fetch', 'force_fetch' or 'insert', got {mode!r} (Invalid mode)"
        )
    if isinstance(data_fields, str) or not isinstance(data_fields, (list, tuple)):
        raise RuntimeError(
            f"data_fields: expected a list of field names, got {type(data_fields).__name__} "
            f"(e.g. data_fields=[{data_fields!r}])"
        )
    if mode != "force_fetch" and (type(batch_size) is not int or batch_size < 1):
        raise RuntimeError(f"batch_size: expected a positive int, got {batch_size!r}")
    if mode == "fetch" and task_name is None:
        raise RuntimeError(
            "task_name: expected the consumer task's name in fetch mode, got None "
            "(each task reads every sample once: e.g. task_name='actor_train')"
        )


def key_list(keys: Any) -> list[str]:
    """``keys`` (one key or a list of them) as a list of strings.

    Raises:
        ValueError: an empty list. TypeError: anything but strings.
    """
    if isinstance(keys, str):
        return [keys]
    if not isinstance(keys, list):
        raise TypeError(f"keys: expected a string or a list of strings, got {type(keys).__name__}")
    if not keys:
        raise ValueError("keys: expected at least one key, got an empty list")
    if not all(map(isinstance, keys, repeat(str))):
        bad = [k for k in keys if not isinstance(k, str)]
        raise TypeError(
            f"keys: expected strings, got {bad[:4]!r} (Not all elements in `keys` are "
            "strings: convert them with str())"
        )
    return keys


def index_list(global_indexes: Any) -> list[int]:
    """``global_indexes`` (one index or a list of them) as a list of ints.

    Raises:
        ValueError: an empty list. TypeError: anything but ints.
    """
    if isinstance(global_indexes, int):
        return [global_indexes]
    if not isinstance(global_indexes, list):
        raise TypeError(
            f"global_indexes: expected an int or a list of ints, got "
            f"{type(global_indexes).__name__}"
        )
    if not global_indexes:
        raise ValueError("global_indexes: expected at least one index, got an empty list")
    if not all(isinstance(i, int) for i in global_indexes):
        raise TypeError("global_indexes: expected ints (Not all elements are int)")
    return global_indexes
