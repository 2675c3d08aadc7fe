"""`python benchmarks/engine.py` runs and prints its table (a tiny model, on CPU)."""

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run

pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_engine_prints_a_table_against_model_generate():
    args = "--batch 3 --prompt-len 8 --new-tokens 6 --stop 8 --vocab 64 --hidden 32 "
    args += "--layers 1 --heads 2 --repeat 2"
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "engine.py"), *args.split()],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    for case in ("greedy", "sampled", "sampled, stop tokens"):
        assert f"| model.generate, {case} |" in out.stdout
        assert f"| HFEngine (dynamic), {case} |" in out.stdout  # the CPU's cache


def test_bench_engine_attention_times_the_sdpa_paths_this_machine_runs():
    args = "--attention --batch 4 --prompt-len 16 --hidden 32 --heads 4"
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "engine.py"), *args.split()],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    lines = {line.split(" | ")[0].strip("| "): line for line in out.stdout.splitlines()}
    assert "| math, grouped view |" in out.stdout
    assert "not run" not in lines["math, grouped view"]  # the CPU runs math; says why not others
    assert "not run" in lines["cuDNN, enable_gqa"]  # a CPU: the reason is printed


def test_engine_demo_bench_times_the_demos_generation_and_its_steps_parts():
    """`benchmarks/_engine_demo.py` on the CPU (the demo's tiny model, the slot cache): its
    rounds, the timed parts of the decode thread's steps and the profiled round."""
    args = "--device cpu --model tiny --kv-cache slots --groups 4 --rounds 2 --top 3"
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "_engine_demo.py"), *args.split()],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    assert "# 32 samples a round, 2 rounds: wall ms p50" in out.stdout
    for part in ("prefill (whole)", "decode (whole)", "record (", "between steps"):
        assert part in out.stdout
    assert "# profiled round: wall" in out.stdout
