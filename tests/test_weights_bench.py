"""`python benchmarks/weights.py` runs and prints its table (a small state dict, on CPU)."""

import json
import multiprocessing as mp
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from _common import receive, start_worker  # noqa: E402
from _weights_engine import model_shapes, specs_of  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run


def test_the_model_shapes_are_exact():
    eight = model_shapes("qwen3-8b")
    moe = model_shapes("qwen3-30b-a3b")
    assert len(eight) == 399 and sum(s.nbytes for s in specs_of(eight)) == 16_381_470_720
    assert len(moe) == 18_867 and sum(s.nbytes for s in specs_of(moe)) == 61_064_245_248
    assert ("model.layers.47.mlp.experts.127.down_proj.weight", (2048, 768)) in moe


def test_bench_weights_prints_a_table_with_the_memcpy_ratio():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "weights.py"), "--scale", "64", "--repeat", "1"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "| memcpy of the same bytes (baseline) |" in out.stdout
    assert "| rlferry shm, packed (zero_copy=False: pack + load, ping-pong) |" in out.stdout
    assert "| rlferry shm, zero copy (the engine loads from the trainer's tensors) |" in out.stdout


def test_bench_weights_sharded_prints_one_json_line_with_its_fields(tmp_path):
    out = tmp_path / "out.jsonl"
    args = ["--senders", "2", "--receivers", "1", "--scale", "64", "--updates", "2"]
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "weights_sharded.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    line = json.loads(out.read_text())
    assert line["identical"] is True and line["updates"] == 2 and len(line["seconds"]) == 2
    assert line["plans_computed"] == 1
    assert sum(line["bytes_per_sender"]) == line["model_bytes"]  # each byte sent once
    assert len(line["bytes_per_sender"]) == 2
    assert "| senders | receivers | mode |" in run.stdout


def test_bench_weights_delta_writes_a_row_per_lr_with_the_issues_fields(tmp_path):
    out = tmp_path / "rows.json"
    args = ["--scale", "64", "--repeat", "2", "--lr", "1e-6,1e-4", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "weights_delta.py"), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    rows = json.loads(out.read_text())
    assert [(r["transport"], r["lr"], r["kind"], r["identical"]) for r in rows] == [
        ("gloo", 1e-6, "delta", True),
        ("gloo", 1e-4, "delta", True),
    ]
    keys = {"changed_fraction", "full_bytes", "sent_bytes", "full_ms_p50", "sent_ms_p50"}
    assert all(keys <= set(r) for r in rows)
    low, high = rows
    assert 0 < low["changed_fraction"] < high["changed_fraction"] <= 1
    assert low["sent_bytes"] < low["full_bytes"] / 4
    assert "| XOR + zlib level 1 |" in run.stdout


def test_bench_weights_sharded_on_fewer_gpus_puts_every_link_across_two():
    import argparse

    from weights_sharded import gpu_of

    args = argparse.Namespace(gpus=2, senders=2, receivers=2)
    assert [gpu_of(args, "trainer", r) for r in range(2)] == [0, 0]
    assert [gpu_of(args, "engine", r) for r in range(2)] == [1, 1]
    args = argparse.Namespace(gpus=0, senders=2, receivers=2)  # a GPU per process
    assert [gpu_of(args, role, r) for role in ("trainer", "engine") for r in range(2)] == [
        0, 1, 2, 3,
    ]  # fmt: skip
    wrong = ["--gpus", "2", "--mode", "gather", "--device", "cuda", "--transport", "broadcast"]
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "weights_sharded.py"), *wrong],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "--gpus: expected 2 or more with --mode sharded" in run.stderr


def _fails(conn):
    raise RuntimeError("a benchmark worker failing on purpose")


def _answers(conn):
    conn.send("the answer")


def test_a_benchmark_worker_that_dies_is_reported_by_what_it_owed_not_waited_for():
    ctx = mp.get_context("spawn")
    _, conn = start_worker(ctx, _answers)
    assert receive(conn, "the answer", wait=120) == "the answer"
    proc, conn = start_worker(ctx, _fails)
    # within the bound, and not by it: the pipe ends when the worker dies
    with pytest.raises(SystemExit, match=r"^the process that owed its rows died \(its error"):
        receive(conn, "its rows", wait=120)
    proc.join(60)
    assert proc.exitcode == 1


def test_every_step_the_push_tracer_stamps_is_still_in_the_code():
    import importlib
    import inspect

    from _trace import TARGETS

    for module, qual in TARGETS:
        owner = importlib.import_module(module)
        cls, _, attr = qual.rpartition(".")
        owner = getattr(owner, cls) if cls else owner
        assert callable(inspect.getattr_static(owner, attr, None)) or isinstance(
            inspect.getattr_static(owner, attr, None), staticmethod
        ), f"benchmarks/_trace.py stamps {module}.{qual}, which is gone: update TARGETS"
