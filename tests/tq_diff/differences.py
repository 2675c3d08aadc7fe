"""Where rlferry's `transfer_queue` answers differently from `transferqueue==0.1.11` on purpose.

Each entry names a place in a scenario's record (the scenario, then the keys down to the
value), the value rlferry gives there, and why. The differential test compares that place with
this value instead of the golden file's. Every entry is a TransferQueue behaviour that is a bug
(against the shim's contract, against its own documentation, or against rlferry's rule that
bad input is refused before anything is stored) and that no framework depends on; each belongs
in the README's list of differences.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Difference:
    path: tuple[str, ...]
    value: Any
    reason: str


_CLEAR_PARTITION = (
    "the shim's contract: after clear_partition(pid) the partition is gone from "
    "get_partition_list() and kv_list(), even when its keys were already cleared (TransferQueue "
    "0.1.11 finds no sample in such a partition, does nothing, and keeps listing it)"
)

_DOCUMENTED_VALUE_ERROR = (
    "TransferQueue 0.1.11 documents a ValueError for kv_batch_get when a key is not found or a "
    "field is empty in a sample, but returns the other samples or fields (or an empty "
    "TensorDict) without a word; rlferry raises the ValueError, naming the key or field"
)
_CHECK_BEFORE_STORE = (
    "rlferry checks a put before it stores or reserves anything; TransferQueue 0.1.11 registers "
    "the keys of a kv_batch_put whose tags do not match its keys, then raises"
)

DIFFERENCES: tuple[Difference, ...] = (
    Difference(("partitions", "partitions_after_clear_b"), ["c"], _CLEAR_PARTITION),
    Difference(("partitions", "kv_list_after_clear_b"), {"c": {}}, _CLEAR_PARTITION),
    Difference(
        ("bad_inputs", "field_missing_from_some_keys"),
        {"raised": "ValueError"},
        _DOCUMENTED_VALUE_ERROR,
    ),
    Difference(("bad_inputs", "unknown_field"), {"raised": "ValueError"}, _DOCUMENTED_VALUE_ERROR),
    Difference(
        ("bad_inputs", "some_keys_unknown"), {"raised": "ValueError"}, _DOCUMENTED_VALUE_ERROR
    ),
    Difference(
        ("bad_inputs", "list_after_mistakes"),
        {"train": {"full": {}, "half": {}}},
        _CHECK_BEFORE_STORE,
    ),
)


def expected(golden: dict[str, Any]) -> dict[str, Any]:
    """The golden records with every declared difference applied.

    Raises KeyError naming the entry when a difference points at a place the golden file does
    not have (a scenario changed and the entry went stale).
    """
    records = copy.deepcopy(golden)
    for difference in DIFFERENCES:
        *parents, leaf = difference.path
        node = records
        for key in parents:
            node = node[key]
        if leaf not in node:
            raise KeyError(f"differences.py: {'.'.join(difference.path)} is not in golden.json")
        node[leaf] = difference.value
    return records
