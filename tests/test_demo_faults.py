"""`rlferry demo` when engines die: a SIGKILLed engine process costs its work, not the run.

The demo runs in this process; a progress callback (each step's end) or the push of an
update kills an engine process (``rlferry serve engine``, a child of this process) by its
pid. The run must finish every step on full batches, train no GRPO group twice, keep its
staleness bound, name the loss and the rejoin, and end with every engine serving the
trainer's last weights bit for bit.
"""

import asyncio
import math
import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (the [demo] extra)")

import rlferry.rl.demo as demo
from rlferry.control import Coordinator, EngineGone

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run

STEPS = 200  # a replacement takes seconds to start (it imports torch): it rejoins mid-run


def engine_pid(name: str) -> int:
    """The pid of this process's child engine ``name`` (``rlferry serve engine --name``)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if parent == me and b"serve" in cmd and name.encode() in cmd:
            return int(entry.name)
    raise AssertionError(f"no engine process {name} under pid {me}")


SLOWER = 0.2  # seconds a step waits more while an engine is missing: its replacement rejoins


@pytest.fixture
def trained(monkeypatch):
    """The GRPO group ids of every batch the run takes, by step. A step taken while an engine
    does not serve waits :data:`SLOWER` more, so that a replacement starting on a loaded
    machine (10-20 s) rejoins well within the run."""
    taken: list[list[int]] = []

    class Recording(Coordinator):
        async def batch(self, groups, **kw):
            out = await super().batch(groups, **kw)
            taken.append([g.group for g in out])
            if self.statistics().engines_serving < 2:
                await asyncio.sleep(SLOWER)
            return out

    monkeypatch.setattr(demo, "Coordinator", Recording)
    return taken


def config() -> demo.DemoConfig:
    return demo.DemoConfig(steps=STEPS, engines=2, max_staleness=1, groups_per_step=2,
                           group_size=4, warm_steps=2)  # fmt: skip


def killing_at(steps: dict[int, str]):
    """A progress callback that SIGKILLs engine ``steps[s]`` at step ``s``'s end."""
    killed: list[tuple[int, str, int]] = []

    def progress(row):
        name = steps.get(row.step)
        if name is not None:
            pid = engine_pid(name)
            os.kill(pid, signal.SIGKILL)
            killed.append((row.step, name, pid))

    return progress, killed


def check_whole_run(run, taken, c):
    assert [s.step for s in run.steps] == list(range(1, c.steps + 1))
    for s in run.steps:  # full batches within the bound, a reward each
        assert s.samples == 8 and len(s.lags) == 8
        assert min(s.lags) >= 0 and max(s.lags) <= c.max_staleness
        assert math.isfinite(s.reward_mean)
    groups = [k for step in taken for k in step]
    assert len(taken) == c.steps and all(len(step) == 2 for step in taken)
    assert len(set(groups)) == len(groups)  # no group trained twice
    # every slot's engine, replacements included, serves the last version bit for bit
    assert run.summary["engine_versions"] == [c.steps, c.steps]
    assert len(run.summary["weights_fingerprint"]) == 64
    assert run.summary["engines not at the last version"] == {}


def test_an_engine_killed_mid_generation_is_replaced_and_every_step_trains_once(trained):
    progress, killed = killing_at({2: "engine0"})
    c = config()
    run = demo.run_demo(c, progress)
    check_whole_run(run, trained, c)
    [(_, _, pid)] = killed
    assert run.summary["engines lost"] == 1
    [loss] = run.summary["engine_losses"]
    assert loss["engine"] == "engine0" and loss["failed"] is None
    assert loss["why"] == f"its process (pid {pid}) exited with code -9"
    assert 2 <= loss["step"] <= loss["rejoined_step"] < c.steps
    assert loss["lost_seconds"] < loss["rejoined_seconds"]


def test_an_engine_killed_mid_update_is_replaced_and_the_update_commits_on_the_other(
    trained, monkeypatch
):
    pushes = demo.pusher
    killed: list[int] = []

    def pusher(ranks, version, sent, pushed=None, pushing=None):  # engine0 dies in the push
        push = pushes(ranks, version, sent, pushed, pushing)

        def killing(seconds):
            if version == 3:
                killed.append(engine_pid("engine0"))
                os.kill(killed[-1], signal.SIGKILL)
            return push(seconds)

        return killing

    monkeypatch.setattr(demo, "pusher", pusher)
    c = config()
    run = demo.run_demo(c)
    check_whole_run(run, trained, c)
    [loss] = run.summary["engine_losses"]
    assert loss["engine"] == "engine0" and loss["step"] == 3
    assert loss["why"] == f"its process (pid {killed[0]}) exited with code -9"
    assert loss["rejoined_step"] is not None and loss["failed"] is None
    assert [s.version for s in run.steps][2] == 3  # the update committed on engine1


def test_both_engines_killed_in_a_row_are_replaced_and_the_run_goes_on(trained):
    # engine1 dies while engine0's replacement starts: for a while no engine serves;
    # the replacements are brought to the trainer's version while the driver waits
    progress, killed = killing_at({2: "engine0", 3: "engine1"})
    c = config()
    run = demo.run_demo(c, progress)
    check_whole_run(run, trained, c)
    assert run.summary["engines lost"] == 2
    losses = {x["engine"]: x for x in run.summary["engine_losses"]}
    assert sorted(losses) == ["engine0", "engine1"]
    for step, name, pid in killed:
        assert losses[name]["why"] == f"its process (pid {pid}) exited with code -9"
        assert step <= losses[name]["step"] <= losses[name]["rejoined_step"] < c.steps


def test_the_run_fails_naming_every_engine_once_none_can_be_replaced(trained, monkeypatch):
    monkeypatch.setattr("rlferry.rl.faults._engines.ENGINE_RESTARTS", 0)
    progress, killed = killing_at({2: "engine0", 3: "engine1"})
    with pytest.raises(EngineGone) as e:
        demo.run_demo(config(), progress)
    why = {name: f"its process (pid {pid}) exited with code -9; its 0 replacements are used up"
           for _, name, pid in killed}  # fmt: skip
    assert e.value.failures == why
    assert str(e.value) == (
        "engine `engine0, engine1`: every engine of the run is lost: "
        f"`engine0`: {why['engine0']}; `engine1`: {why['engine1']}"
    )
