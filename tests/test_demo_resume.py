"""A demo job survives its driver killed (SIGKILL of its whole process group) at any point:
resumed from its last whole checkpoint, it trains every step once, no sample twice, and
``trained.jsonl`` alone shows it. Plus the checkpoints' own rules and refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlferry.errors import RequestError
from rlferry.rl.checkpoints import (
    KILL_ENV,
    Checkpoints,
    TrainedLog,
    check_resumable,
    load_rank,
    save_rank,
)
from rlferry.rl.demo import DemoConfig
from rlferry.wire import FileFormatError

GROUPS, SIZE = 2, 2
RUN = """
import json, sys
from rlferry.rl.demo import DemoConfig, run_demo
from rlferry.rl.report import write_report
if __name__ == "__main__":
    out, steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
    config = DemoConfig(steps=steps, engines=1, groups_per_step=2, group_size=2, warm_steps=0,
                        max_staleness=1, out=out, checkpoint_every=2, resume=resume)
    run = run_demo(config)
    write_report(out, [run])
    figures = {k: v for k, v in run.summary.items() if isinstance(v, (int, float))}
    steps = [s.step for s in run.steps]
    print(json.dumps({"steps": steps, "lags": [max(s.lags) for s in run.steps],
                      "summary": figures}))
"""


def _demo(tmp: Path, steps: int, resume: str = "", kill: str | None = None) -> tuple[int, str]:
    """Run the demo in a process group of its own; ``kill``: its fault point."""
    script = tmp / "run.py"
    script.write_text(RUN)
    env = {k: v for k, v in os.environ.items() if k != KILL_ENV}
    if kill is not None:
        env[KILL_ENV] = kill
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp / "out"), str(steps), resume],
        env=env, capture_output=True, text=True, timeout=300, start_new_session=True,
    )  # fmt: skip
    return proc.returncode, proc.stderr + "\n" + proc.stdout  # the result: the last line


def _trained(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trained.jsonl").read_text().splitlines()]


def _check_exactly_once(tmp: Path, steps: int, stdout: str) -> None:
    rows = _trained(tmp / "out")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    uids = [u for r in rows for u in r["uids"]]
    assert all(len(r["uids"]) == GROUPS * SIZE for r in rows)
    assert len(set(uids)) == len(uids), "a sample was trained twice"
    groups = {int(u.split("/")[0]) for u in uids}
    assert len(groups) == GROUPS * steps
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["steps"] == list(range(1, steps + 1))  # the report covers the whole run
    assert max(result["lags"]) <= 1  # the staleness bound held across the restart
    assert result["summary"]["trainer_version"] == steps  # the engines' weights checked too
    runs = json.loads((tmp / "out" / "runs.json").read_text())
    assert [s["step"] for s in runs[0]["steps"]] == list(range(1, steps + 1))


def _killed_then_resumed(tmp: Path, kill: str, steps: int = 5, again: str | None = None) -> None:
    rc, text = _demo(tmp, steps, kill=kill)
    assert rc == -signal.SIGKILL, text[-3000:]
    ckpt = str(tmp / "out" / "checkpoints")
    if again is not None:  # killed again during the resumed run
        rc, text = _demo(tmp, steps, ckpt, kill=again)
        assert rc == -signal.SIGKILL, text[-3000:]
    rc, text = _demo(tmp, steps, ckpt)
    assert rc == 0, text[-3000:]
    _check_exactly_once(tmp, steps, text)


def test_a_driver_killed_between_steps_resumes_and_trains_every_sample_once(tmp_path):
    _killed_then_resumed(tmp_path, "step:3")


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill",
    ["put:3", "train:3", "push:3", "put:4", "checkpoint:4", "step:2", "step:4", "push:4",
     "train:5", "put:5"],
)  # fmt: skip
def test_a_driver_killed_anywhere_resumes_and_trains_every_sample_once(tmp_path, kill):
    _killed_then_resumed(tmp_path, kill)


@pytest.mark.slow
def test_a_driver_killed_during_the_first_step_after_a_resume_resumes_again(tmp_path):
    _killed_then_resumed(tmp_path, "step:3", again="resumed:3")


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["train:1", "checkpoint:2"])
def test_a_driver_killed_before_its_first_checkpoint_has_nothing_to_resume(tmp_path, kill):
    rc, text = _demo(tmp_path, 5, kill=kill)
    assert rc == -signal.SIGKILL, text[-3000:]
    rc, text = _demo(tmp_path, 5, str(tmp_path / "out" / "checkpoints"))
    assert rc != 0
    assert "no whole step-* checkpoint" in text


def _saved(tmp: Path, step: int, ckpts: Checkpoints) -> Path:
    ckpts.base.mkdir(parents=True, exist_ok=True)
    tmp_dir = ckpts.begin(step)
    (tmp_dir / "job.rlf").write_bytes(b"")
    return ckpts.commit(tmp_dir, step)


def test_checkpoints_keep_the_last_whole_ones_and_ignore_unfinished_writes(tmp_path):
    ckpts = Checkpoints(tmp_path / "c", keep=2)
    for step in (2, 4, 6):
        _saved(tmp_path, step, ckpts)
    ckpts.begin(8)  # a write that never finished
    assert [s for s, _ in ckpts.whole()] == [4, 6]
    assert ckpts.latest()[0] == 6
    new_run = r"checkpoint_dir: expected a directory without checkpoints for a new run, got "
    with pytest.raises(RequestError, match=new_run + r".* \(continue it with --resume"):
        ckpts.check_new()
    written = r"resume: expected a checkpoint directory written by `rlferry demo --checkpoint"
    with pytest.raises(RequestError, match=written + r"-every N`, got .* with no base/ dir"):
        Checkpoints(tmp_path / "nothing").latest()
    with pytest.raises(RequestError, match=r"checkpoint_keep: expected an int >= 1, got 0"):
        Checkpoints(tmp_path, keep=0)


def test_trained_jsonl_is_cut_back_to_the_checkpoint_and_drops_a_line_cut_short(tmp_path):
    log = TrainedLog(tmp_path / "trained.jsonl")
    for step in (1, 2, 3):
        log.append(step, step, [f"{step}/0"])
    log.close()
    with open(tmp_path / "trained.jsonl", "a") as f:
        f.write('{"step": 4, "vers')  # the driver killed mid-line
    log = TrainedLog(tmp_path / "trained.jsonl", after=2)
    log.append(3, 3, ["9/0"])
    log.close()
    assert [r["uids"] for r in _trained(tmp_path)] == [["1/0"], ["2/0"], ["9/0"]]
    TrainedLog(tmp_path / "trained.jsonl").close()  # a new run starts it empty
    assert (tmp_path / "trained.jsonl").read_text() == ""


def test_a_resume_under_other_settings_is_refused_naming_the_setting(tmp_path):
    config = DemoConfig(steps=4, group_size=4)
    saved = {**{k: getattr(config, k) for k in ("model", "lora", "seed", "device", "layout",
                                                "engine", "groups_per_step", "max_staleness",
                                                "sync")}, "group_size": 8}  # fmt: skip
    with pytest.raises(RequestError, match=r"resume: group_size: expected 8 \(as the run that "
                       r"wrote .* had\), got 4 \(resume with the same --group-size\)"):  # fmt: skip
        check_resumable(config, saved, tmp_path)


def test_a_rank_file_round_trips_parameters_optimizer_and_rng_and_refuses_another_model(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save_rank(tmp_path, 0, params, opt)
    expected = torch.rand(3)
    other = torch.nn.Linear(4, 3)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    load_rank(tmp_path, 0, list(other.parameters()), other_opt)
    assert torch.rand(3).equal(expected)  # the RNG where it was saved
    for p, q in zip(params, other.parameters(), strict=True):
        assert p.equal(q)
        assert opt.state[p]["exp_avg"].equal(other_opt.state[q]["exp_avg"])
        assert opt.state[p]["step"].equal(other_opt.state[q]["step"])
    wider = torch.nn.Linear(5, 3)
    with pytest.raises(RequestError, match=r"trainer-0.rlf: trained tensor 0 expected \[3, 5\] "
                       r"torch.float32, got \[3, 4\] torch.float32 \(resume with the same "
                       r"model"):  # fmt: skip
        load_rank(tmp_path, 0, list(wider.parameters()), torch.optim.AdamW(wider.parameters()))
    with pytest.raises(RequestError, match=r"trainer-1.rlf \(trainer rank 1's part of the "
                       r"checkpoint\), got no such file"):  # fmt: skip
        load_rank(tmp_path, 1, params, opt)
    data = bytearray((tmp_path / "trainer-0.rlf").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "trainer-0.rlf").write_bytes(bytes(data))
    with pytest.raises(FileFormatError, match=r"trainer-0.rlf"):
        load_rank(tmp_path, 0, params, opt)


def test_trainers_start_again_on_another_port_when_theirs_was_taken(monkeypatch):
    from rlferry.rl import _processes

    calls = []

    def start(procs, settings):
        calls.append(settings["port"])
        if len(calls) == 1:
            raise RuntimeError("trainer rank 0: DistNetworkError: ... EADDRINUSE ...")
        return ["tcp://127.0.0.1:1"]

    monkeypatch.setattr(_processes, "_start_trainers", start)
    settings = {"port": 1}
    assert _processes.start_trainers(_processes.Processes(), settings) == ["tcp://127.0.0.1:1"]
    assert calls[0] == 1 and calls[1] == settings["port"] != 1
    monkeypatch.setattr(_processes, "_start_trainers", lambda p, s: (_ for _ in ()).throw(
        RuntimeError("trainer rank 0: ValueError: bad")))  # fmt: skip
    with pytest.raises(RuntimeError, match="bad"):  # any other failure is told at once
        _processes.start_trainers(_processes.Processes(), settings)
