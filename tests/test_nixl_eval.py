"""`python benchmarks/nixl_eval.py` runs and prints its table (a small state dict, on CPU).

NIXL is not a dependency of rlferry (nor of its CI): without it the test skips."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"

if importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "NIXL is not installed (pip install nixl-cu12 to run benchmarks/nixl_eval.py)",
        allow_module_level=True,
    )


def test_nixl_eval_prints_every_row_each_checked():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "nixl_eval.py"), "--scale", "64", "--repeat", "2"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    assert "| memcpy of the same bytes, one process (baseline) |" in out.stdout
    assert "| rlferry shm, zero copy (the engine loads from the trainer's tensors) |" in out.stdout
    assert "| NIXL UCX WRITE, one request of 399 descriptors |" in out.stdout
    assert "checked after every update" in out.stdout
    assert "NIXL backends: UCX DRAM+VRAM" in out.stdout
