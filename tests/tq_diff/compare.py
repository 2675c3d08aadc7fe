"""Field-by-field comparison of two scenario records, one readable line per difference."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 160 else text[:157] + "..."


def mismatches(expected: Any, got: Any, path: str) -> Iterator[str]:
    """One line per place where `got` differs from `expected`: the path, TransferQueue's, ours.

    Values compare by type too (`true` is not `1`).
    """
    if isinstance(expected, dict) and isinstance(got, dict):
        for key in sorted(set(expected) | set(got), key=str):
            where = f"{path}.{key}"
            if key not in got:
                yield f"{where}: missing; TransferQueue gives {_short(expected[key])}"
            elif key not in expected:
                yield f"{where}: TransferQueue has no such entry; got {_short(got[key])}"
            else:
                yield from mismatches(expected[key], got[key], where)
    elif isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        for i, (want, have) in enumerate(zip(expected, got, strict=True)):
            yield from mismatches(want, have, f"{path}[{i}]")
    elif expected != got or type(expected) is not type(got):
        yield f"{path}: TransferQueue gives {_short(expected)}; got {_short(got)}"
