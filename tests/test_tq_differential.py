"""Differential tests: rlferry's `transfer_queue` gives what `transferqueue==0.1.11` gives.

Every scenario of `tq_diff/scenarios.py` runs on rlferry's implementation (after
`rlferry.compat.transferqueue.install()`) and its record is compared, field by field, with
what the real package recorded in `tq_diff/golden.json` (regenerate it with
`.venv-tq/bin/python tests/tq_diff/record.py`, see that script), except for the deliberate
differences declared in `tq_diff/differences.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tq_diff import differences
from tq_diff.compare import mismatches

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run

GOLDEN_PATH = Path(__file__).parent / "tq_diff" / "golden.json"
GOLDEN = json.loads(GOLDEN_PATH.read_text())["scenarios"]


@pytest.fixture(scope="module")
def tq() -> Any:
    shim = pytest.importorskip(
        "rlferry.compat.transferqueue",
        # ImportError too: a shim whose [tq] extra (tensordict, omegaconf) is missing says so.
        exc_type=ImportError,
        reason="rlferry.compat.transferqueue (issue 21) or its [tq] extra is not importable here",
    )
    shim.install()
    import transfer_queue

    return transfer_queue


def test_every_scenario_has_a_golden_record(tq):
    from tq_diff.scenarios import SCENARIOS

    assert sorted(GOLDEN) == sorted(SCENARIOS), (
        "tq_diff/golden.json is out of date: regenerate it with "
        "`.venv-tq/bin/python tests/tq_diff/record.py`"
    )


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_scenario_matches_transferqueue(tq, name):
    from tq_diff.scenarios import SCENARIOS

    got = json.loads(json.dumps(SCENARIOS[name](tq)))
    want = differences.expected(GOLDEN)[name]
    found = [_mark_declared(line) for line in mismatches(want, got, name)]
    assert not found, f"{len(found)} difference(s) from transferqueue 0.1.11:\n" + "\n".join(found)


def _mark_declared(line: str) -> str:
    """Say so where the expected value is one of differences.py's, not TransferQueue's."""
    for difference in differences.DIFFERENCES:
        path = ".".join(difference.path)
        if line.startswith((f"{path}:", f"{path}.", f"{path}[")):
            return f"{line} (expected: declared in tq_diff/differences.py: {difference.reason})"
    return line


def test_every_declared_difference_differs_from_a_recorded_value():
    for difference in differences.DIFFERENCES:
        node = GOLDEN
        for key in difference.path:
            node = node[key]  # a KeyError names a stale entry of differences.py
        assert node != difference.value, f"{difference.path} is what TransferQueue gives: drop it"


def test_mismatches_name_the_path_and_both_values():
    want = {"a": [1, {"b": True}], "c": 1, "e": [1, 2]}
    got = {"a": [1, {"b": 1}], "d": 2, "e": [1]}
    assert list(mismatches(want, got, "s")) == [
        "s.a[1].b: TransferQueue gives true; got 1",
        "s.c: missing; TransferQueue gives 1",
        "s.d: TransferQueue has no such entry; got 2",
        "s.e: TransferQueue gives [1, 2]; got [1]",
    ]
