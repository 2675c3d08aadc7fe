"""`rlferry demo` under NVIDIA MPS: when a run wants it, a daemon that cannot start or serve
(the run goes on without, saying why), a real daemon on a GPU, and the runs in a child."""

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import requires_cuda
from rlferry.rl._mps import CONTROL, mps_for, private_mps


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
def test_runs_in_a_child_write_the_report_and_leave_this_environment_as_it_was(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers (the [demo] extra)")
    pytest.importorskip("matplotlib", reason="needs matplotlib (the [demo] extra)")
    from rlferry.rl.command import _in_child
    from rlferry.rl.demo import DemoConfig

    config = DemoConfig(
        steps=2, engines=1, max_staleness=1, groups_per_step=2, group_size=4, warm_steps=0,
        mps="the test's",
    )  # fmt: skip
    report = _in_child([config], str(tmp_path), {"RLFERRY_TEST_CHILD": "1"})
    assert report == tmp_path / "report.md" and "the test's" in report.read_text()
    (run,) = json.loads((tmp_path / "runs.json").read_text())
    assert [s["step"] for s in run["steps"]] == [1, 2]
    assert "RLFERRY_TEST_CHILD" not in os.environ  # set while the child started only
