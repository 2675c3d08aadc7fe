"""`rlferry demo` under NVIDIA MPS: when a run wants it, a daemon that cannot start or serve
(the run goes on without, saying why), a real daemon on a GPU, and the runs in a child."""

import argparse
import contextlib
import dataclasses
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import requires_cuda
from rlferry.rl._mps import CONTROL, Mps, mps_for, private_mps


def test_mps_is_wanted_only_where_the_runs_processes_share_a_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    assert mps_for("cpu", "colocated", "local", refused=False) is None
    assert mps_for("cuda", "split", "local", refused=False) is None
    assert mps_for("cuda", "colocated", "ray", refused=False) is None
    off = mps_for("cuda", "colocated", "local", refused=True)
    assert off is not None and not off.on and off.why == "off (--no-mps)"


def test_a_daemon_the_caller_runs_is_used_and_none_is_started(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    mine = mps_for("cuda", "colocated", "local", refused=False)
    assert mine is not None and mine.on and not mine.start
    assert mine.why == f"the daemon at {tmp_path}" and mine.env == {}


@pytest.mark.skipif(Path("/tmp/nvidia-mps/control").exists(), reason="a system MPS daemon runs")
def test_without_nvidias_control_program_mps_is_off_and_says_so(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no nvidia-cuda-mps-control
    off = mps_for("cuda", "colocated", "local", refused=False)
    assert off is not None and not off.on
    assert off.why == f"off ({CONTROL} is not on PATH: NVIDIA's driver tools)"


def _control(tmp_path: Path, script: str) -> None:
    """An nvidia-cuda-mps-control on PATH that runs ``script`` (a shell body), for a
    daemon that fails: the real one needs NVIDIA's driver."""
    path = tmp_path / CONTROL
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_daemon_that_does_not_start_leaves_the_run_without_mps_saying_why(monkeypatch, tmp_path):
    _control(tmp_path, 'echo "An instance of this daemon is already running" >&2; exit 1')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    before = set(Path(tempfile.gettempdir()).glob("rlferry-mps-*"))
    with private_mps() as mps:
        assert not mps.on and mps.env == {}
        assert mps.why == (
            f"off ({CONTROL} -d exited with 1: An instance of this daemon is already running)"
        )
    assert set(Path(tempfile.gettempdir()).glob("rlferry-mps-*")) == before  # removed


@pytest.mark.skipif(shutil.which(CONTROL) is not None, reason="NVIDIA's driver is here")
def test_a_daemon_whose_first_client_fails_is_told_to_quit_and_the_run_goes_without(
    monkeypatch, tmp_path
):
    # the daemon "starts"; the first client (a process of its own) finds no CUDA driver
    said = tmp_path / "said"
    _control(tmp_path, f'cat >> {said}; echo "$CUDA_MPS_PIPE_DIRECTORY" >> {said}')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with private_mps() as mps:
        assert not mps.on and mps.env == {}
        assert mps.why.startswith("off (") and "libcuda.so.1" in mps.why
    lines = said.read_text().splitlines()
    # "-d" reads no input; then "quit", told to the daemon of the run's pipes, now removed
    assert "quit" in lines and lines[-1].endswith("/pipe")
    assert not Path(lines[-1]).exists()


@requires_cuda
@pytest.mark.skipif(shutil.which(CONTROL) is None, reason=f"needs {CONTROL} (NVIDIA's driver)")
def test_on_a_gpu_the_runs_daemon_serves_its_processes_and_quits_after_them():
    with private_mps() as mps:
        assert mps.on, mps.why
        pipe = Path(mps.env["CUDA_MPS_PIPE_DIRECTORY"])
        assert (pipe / "control").exists()
        client = "import torch; print(torch.ones(4, device='cuda').sum().item())"
        done = subprocess.run(
            [sys.executable, "-c", client],
            env={**os.environ, **mps.env}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "4.0"
        servers = subprocess.run(
            [CONTROL], input="get_server_list\n", env={**os.environ, **mps.env},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert servers.stdout.strip(), "the daemon started no server for its clients"
    assert not pipe.exists()  # the daemon quit and its directories are removed


@pytest.mark.slow
def test_runs_in_a_child_come_back_and_leave_this_environment_as_it_was(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers (the [demo] extra)")
    from rlferry.rl.command import _in_child
    from rlferry.rl.demo import DemoConfig

    config = DemoConfig(
        steps=2, engines=1, max_staleness=1, groups_per_step=2, group_size=4, warm_steps=0,
        mps="the test's", out=str(tmp_path),
    )  # fmt: skip
    (run,) = _in_child([config], {"RLFERRY_TEST_CHILD": "1"})
    assert [s.step for s in run.steps] == [1, 2] and run.config["mps"] == "the test's"
    assert "RLFERRY_TEST_CHILD" not in os.environ  # set while the child started only


def test_a_synchronous_run_goes_without_mps_and_an_asynchronous_one_under_it(monkeypatch, tmp_path):
    """``--compare`` on one GPU: the synchronous run in a child without the daemon's
    address, started before the daemon; the asynchronous one in a child with it; one report
    of both (the runs themselves replaced: no GPU here)."""
    from rlferry import cli
    from rlferry.rl import command

    monkeypatch.setattr(command, "mps_for", lambda *a: Mps(True, "own", {}, start=True))
    seen = []

    @contextlib.contextmanager
    def daemon():
        seen.append("daemon")
        yield Mps(True, "a daemon of the run's own", {"CUDA_MPS_PIPE_DIRECTORY": "/p"})

    def in_child(configs, env):
        seen.append([(c.max_staleness, c.mps, dict(env)) for c in configs])
        return [command.RunRecord(name=c.name, config=dataclasses.asdict(c)) for c in configs]

    monkeypatch.setattr(command, "private_mps", daemon)
    monkeypatch.setattr(command, "_in_child", in_child)
    monkeypatch.setattr(command, "write_report", lambda out, runs: out / "report.md")
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)  # the settings' check of a GPU
    parser = argparse.ArgumentParser()
    cli._demo_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo", "--compare", "--device", "cuda", "--out", str(tmp_path)])
    report = command.main(args)
    assert seen == [
        [(0, command.SYNCHRONOUS, {})],
        "daemon",
        [(2, "a daemon of the run's own", {"CUDA_MPS_PIPE_DIRECTORY": "/p"})],
    ]
    assert report == tmp_path / "report.md"
