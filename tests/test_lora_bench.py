"""`python benchmarks/_lora_bench.py` runs, checks every adapter push and writes its row."""

import json
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = pytest.mark.slow  # two processes and a gloo group


def test_the_lora_bench_writes_a_row_of_a_lora_push_against_a_full_push(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "_lora_bench.py"), "--scale", "16", "--repeat", "1",
         "--transport", "gloo", "--json", str(out)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    assert "| gloo |" in run.stdout
    (row,) = json.loads(out.read_text())
    assert {k: row[k] for k in ("transport", "lr", "kind", "identical", "changed_fraction")} == {
        "transport": "gloo", "lr": None, "kind": "lora", "identical": True,
        "changed_fraction": None,
    }  # fmt: skip
    # rank 16 / 16 = 1 on widths / 16: the 188x of any scale where the rank divides evenly
    assert row["rank"] == 1 and row["full_bytes"] > 150 * row["sent_bytes"]
    assert row["full_ms_p50"] > 0 and row["sent_ms_p50"] > 0
