"""Where rlferry's `transfer_queue` answers differently from `transferqueue==0.1.11` on purpose.

Each entry names a place in a scenario's record (the scenario, then the keys down to the
value), the value rlferry gives there, and why. The differential test compares that place with
this value instead of the golden file's. Every entry is a TransferQueue behaviour that is a bug
no framework depends on; each is also listed in the README's list of differences.
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
    "issue 21: after clear_partition(pid) the partition is gone from get_partition_list() and "
    "kv_list(), even when its keys were already cleared (TransferQueue 0.1.11 finds no sample "
    "in such a partition, does nothing, and keeps listing it)"
)

DIFFERENCES: tuple[Difference, ...] = (
    Difference(("partitions", "partitions_after_clear_b"), ["c"], _CLEAR_PARTITION),
    Difference(("partitions", "kv_list_after_clear_b"), {"c": {}}, _CLEAR_PARTITION),
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
