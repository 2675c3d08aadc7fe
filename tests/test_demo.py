"""`rlferry demo` end to end: a short run on the tiny model, and Ctrl-C."""

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import requires_cuda

pytest.importorskip("transformers", reason="needs transformers (the [demo] extra)")
pytest.importorskip("matplotlib", reason="needs matplotlib (the [demo] extra)")

from rlferry.rl.demo import DemoConfig, run_demo
from rlferry.rl.report import summarize, write_report

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run


def test_a_short_demo_trains_within_its_staleness_and_ends_with_the_trainers_weights(tmp_path):
    config = DemoConfig(
        steps=4, engines=2, max_staleness=1, groups_per_step=2, group_size=4, warm_steps=5
    )
    run = run_demo(config)
    assert [s.step for s in run.steps] == [1, 2, 3, 4]
    for s in run.steps:
        assert s.samples == 8 and len(s.lags) == 8
        assert max(s.lags) <= config.max_staleness and min(s.lags) >= 0
    versions = [s.version for s in run.steps]
    assert versions == sorted(versions) and versions[-1] == 4
    # the run checked that the engines hold the trainer's last weights bit for bit
    assert run.summary["engine_versions"] == [4, 4]
    assert len(run.summary["weights_fingerprint"]) == 64
    run.summary = {**summarize(run), "trainer_version": 4}
    report = write_report(tmp_path, [run])
    for name in ("reward_by_step.png", "reward_by_time.png", "phases.png", "staleness.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "async (max_staleness=1)" in report.read_text()


def test_the_demos_trainer_ranks_each_push_only_the_shards_they_own():
    from rlferry.rl.model import make_model
    from rlferry.rl.task import ReverseTask
    from rlferry.weights import fsdp_layout, specs_of

    config = DemoConfig(
        steps=2, engines=2, max_staleness=1, groups_per_step=2, group_size=4, warm_steps=0
    )
    assert config.gpus()[1] == 2  # two FSDP2 ranks on the CPU
    run = run_demo(config)
    assert run.summary["engine_versions"] == [2, 2]
    assert len(run.summary["weights_fingerprint"]) == 64  # bit for bit, checked by the run
    # each rank pushed its rows of every tensor (FSDP2's dim-0 chunks), nothing else:
    # the model's bytes over the two ranks, no rank the whole model
    model = make_model(config.model, ReverseTask().tokenizer.vocab_size, seed=0)
    specs = specs_of(model.state_dict().items())
    layout = fsdp_layout(specs, 2)
    sent = run.summary["weights_bytes_per_rank"]
    whole = sum(s.nbytes for s in specs)
    assert sent == [layout.owned_bytes(0), layout.owned_bytes(1)]
    assert sum(sent) == whole and all(0.45 * whole < b < 0.55 * whole for b in sent)


@requires_cuda
def test_on_one_gpu_the_demos_rank_pushes_its_weights_by_cuda_ipc():
    import torch

    from rlferry.rl.model import make_model
    from rlferry.rl.task import ReverseTask

    config = DemoConfig(steps=2, engines=2, max_staleness=1, groups_per_step=2, group_size=4,
                        warm_steps=0, device="cuda")  # fmt: skip
    run = run_demo(config)
    assert run.summary["engine_versions"] == [2, 2]
    assert len(run.summary["weights_fingerprint"]) == 64  # bit for bit, checked by the run
    model = make_model(config.model, ReverseTask().tokenizer.vocab_size, seed=0)
    whole = sum(t.nbytes for t in model.state_dict().values())  # float32: the tiny preset's
    sent = run.summary["weights_bytes_per_rank"]
    # the GPU busy share from NVML's samples, or why there is none (never a failed run)
    share = run.summary.get("GPU busy, % of the run (NVML)")
    assert (share is not None and 0 <= share <= 100) or run.summary["gpu_busy_why"]
    if torch.cuda.device_count() == 1:  # one rank beside the engines: it pushes everything
        assert sent == [whole]
    else:  # rank 1 on GPU 1: a link per engine from each rank (point to point), its own rows
        from rlferry.weights import fsdp_layout, specs_of

        owned = fsdp_layout(specs_of(model.state_dict().items()), 2)
        assert sent == [2 * owned.owned_bytes(0), 2 * owned.owned_bytes(1)]


@requires_cuda
@pytest.mark.parametrize(
    ("layout", "engines", "gpus"), [("colocated", 1, 2), ("colocated", 2, 2), ("split", 2, 4)]
)
def test_on_several_gpus_the_demos_ranks_push_their_own_shards(layout, engines, gpus):
    import torch

    from rlferry.rl.model import make_model
    from rlferry.rl.task import ReverseTask
    from rlferry.weights import fsdp_layout, specs_of

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}")
    config = DemoConfig(steps=2, engines=engines, max_staleness=1, groups_per_step=2,
                        group_size=4, warm_steps=0, device="cuda", layout=layout)  # fmt: skip
    assert config.gpus()[1] == 2
    run = run_demo(config)
    assert run.summary["engine_versions"] == [2] * engines
    assert len(run.summary["weights_fingerprint"]) == 64  # bit for bit, checked by the run
    model = make_model(config.model, ReverseTask().tokenizer.vocab_size, seed=0)
    owned = fsdp_layout(specs_of(model.state_dict().items()), 2)
    # rank 0 by cuda_ipc beside the engines (colocated) or NCCL (split), rank 1 by NCCL:
    # each its own rows, nothing gathered; engines sharing GPU 0 (colocated, 2) cannot be
    # in one NCCL group: a link per engine from each rank, its rows once to each
    per = engines if layout == "colocated" else 1
    sent = run.summary["weights_bytes_per_rank"]
    assert sent == [per * owned.owned_bytes(0), per * owned.owned_bytes(1)]


def _session_processes(sid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


# the runs in a child process of their own, as under MPS (``rlferry demo`` colocated on CUDA)
_IN_A_CHILD = """import sys
from rlferry.rl.command import _in_child
from rlferry.rl.demo import DemoConfig
try:
    _in_child([DemoConfig(steps=500, engines=2, out=sys.argv[1])], {})
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.timeout(240)  # its start alone takes up to 70 s on a loaded machine
@pytest.mark.parametrize("where", ["here", "in_a_child"])
def test_ctrl_c_stops_every_process_of_the_demo_and_leaves_no_shared_memory(tmp_path, where):
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    cmd = [sys.executable, "-m", "rlferry.cli", "demo", "--steps", "500", "--engines", "2",
           "--out", str(tmp_path)]  # fmt: skip
    if where == "in_a_child":  # a terminal's Ctrl-C reaches the command, which tells the child
        cmd = [sys.executable, "-c", _IN_A_CHILD, str(tmp_path)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=_terminal_sigint,
    )  # fmt: skip
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + 180  # it starts in 10-20 s; on a loaded machine 70 s
    while b"1/500" not in seen:  # the progress bar's first step: everything runs
        if not select.select([proc.stderr], [], [], max(0.0, deadline - time.monotonic()))[0]:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the demo made no first step within 180 s: {seen[-2000:]!r}")
        chunk = proc.stderr.read1(4096)
        assert chunk, f"the demo ended before its first step: {seen[-2000:]!r}"
        seen += chunk
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal reaches the whole group
    rc = proc.wait(30)
    assert rc == 130, f"exit status {rc}; the demo said: {(seen + proc.stderr.read())[-3000:]!r}"
    # multiprocessing's resource tracker (started with the trainers) ends when it reads the
    # end of its pipe, a moment after the demo itself: each process left may take 10 s
    left = {}
    for pid in _session_processes(proc.pid):
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            fd = os.pidfd_open(pid)
            try:
                if not select.select([fd], [], [], 10)[0]:
                    left[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            finally:
                os.close(fd)
    assert left == {}
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert shm_after - shm_before == set()


def test_a_demo_setting_that_cannot_work_is_refused_before_anything_starts():
    out = subprocess.run(
        [sys.executable, "-m", "rlferry.cli", "demo", "--engines", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr == "rlferry demo: engines: expected an int >= 1, got 0\n"


def test_a_step_takes_16_groups_on_the_cpu_unless_told():
    assert DemoConfig().groups_per_step == 16
    assert DemoConfig(groups_per_step=4).groups_per_step == 4


def test_demo_settings_that_cannot_work_name_the_setting_and_the_fix():
    with pytest.raises(ValueError) as e:
        DemoConfig(layout="split")
    assert str(e.value) == (
        "layout: 'split' places engines and trainers on GPUs: use --device cuda"
    )
    with pytest.raises(ValueError, match=r"^layout: expected 'colocated' or 'split', got 'far'$"):
        DemoConfig(layout="far")
    with pytest.raises(ValueError, match=r"^engine: expected 'hf' or 'vllm', got 'tgi'$"):
        DemoConfig(engine="tgi")


def test_a_wrong_ray_address_fails_at_once_naming_it():
    import socket

    pytest.importorskip("ray", reason="needs Ray (the [ray] extra)")
    from rlferry.rl._processes import check_ray_address

    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
        # refused before Ray is joined (Ray itself waits minutes for a GCS not there)
        with pytest.raises(ValueError, match=f"expected a running Ray head at '{dead}'"):
            run_demo(DemoConfig(steps=1, launcher="ray", ray_address=dead))
    with pytest.raises(ValueError, match="expected HOST:PORT of a running Ray head"):
        check_ray_address("localhost")
    with socket.socket() as s:  # one that listens is accepted
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_ray_address(f"ray://127.0.0.1:{s.getsockname()[1]}")


def _terminal_sigint():
    """In the demo's process, before it starts: SIGINT as a terminal's foreground job has it
    (a shell's background job, as a CI script may be, starts with SIGINT ignored, and
    Python keeps it so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_ctrl_c_is_an_interrupt_even_when_a_peer_it_stopped_failed_the_run_first():
    """A Ctrl-C reaches the engine processes too: on a loaded machine the run failed on an
    engine that had stopped (exit 1) before asyncio cancelled it. The run is an interrupt
    (KeyboardInterrupt, the CLI's 130); a failure without a Ctrl-C stays what it is; the
    SIGINT handler is Python's own again after either."""
    from rlferry.rl.demo import run_hearing_ctrl_c

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal
    try:
        _interrupt_or_failure(run_hearing_ctrl_c)
    finally:
        signal.signal(signal.SIGINT, before)


def _interrupt_or_failure(run_hearing_ctrl_c):
    async def stopped_peer():
        os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C, which stopped an engine first
        raise ConnectionRefusedError("engine0: /pause: unreachable")

    with pytest.raises(KeyboardInterrupt, match="the run also failed: ConnectionRefusedError"):
        run_hearing_ctrl_c(stopped_peer)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    async def failed():
        raise ConnectionRefusedError("engine0: /pause: unreachable")

    with pytest.raises(ConnectionRefusedError):
        run_hearing_ctrl_c(failed)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    async def fine():
        return 7

    assert run_hearing_ctrl_c(fine) == 7
