"""`python benchmarks/ragged_rows.py` runs and prints its three rows with their ratios."""

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_ragged_rows_bench_prints_put_get_and_padding_against_a_plain_list():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "ragged_rows.py"), "--iterations", "3"],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    for name in ("put", "get", "pad"):
        row = re.search(rf"^ *{name}: RaggedRows ([\d.]+) / .* list ([\d.]+) / .*\(list / "
                        rf"RaggedRows: ([\d.]+)x\)$", out.stdout, re.M)  # fmt: skip
        assert row is not None, out.stdout
        ragged, plain, ratio = map(float, row.groups())
        assert ragged > 0 and plain > 0 and ratio > 0
