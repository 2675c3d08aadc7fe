"""The demo's report: a run's figures, the progress bar's strings, report.md and its plots."""

import math
import subprocess
import sys

import pytest

from rlferry.rl.report import (
    RunRecord,
    StepRecord,
    format_progress,
    read_runs,
    summarize,
    write_report,
)

PLOTS = ("reward_by_step.png", "reward_by_time.png", "phases.png", "staleness.png")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step(i, *, wall, reward, wait=1.0, lags=(0,) * 8, **kw):
    lags = list(lags)
    fields = dict(
        step=i,
        wall=wall,
        reward_mean=reward,
        reward_max=1.0,
        samples=len(lags),
        samples_per_s=4.0,
        staleness_mean=sum(lags) / max(1, len(lags)),
        staleness_max=max(lags, default=0),
        generate_seconds=1.0,
        wait_seconds=wait,
        train_seconds=0.75,
        sync_seconds=0.25,
        loss=0.5,
        lags=lags,
        version=i,
    )
    return StepRecord(**(fields | kw))


def sync_run():
    """10 steps of 2 s each (1 s waiting), reward 0.1 to 1.0, every lag 0."""
    steps = [step(i, wall=2.0 * i, reward=i / 10) for i in range(1, 11)]
    return RunRecord("sync", {"max_staleness": 0, "engines": 2, "lr": 1e-05}, steps)


def async_run():
    """10 steps of 1 s each (no waiting), reward 0.15 to 1.05, lags 0, 1, 1, 2 twice."""
    steps = [
        step(i, wall=1.0 * i, reward=i / 10 + 0.05, wait=0.0, lags=(0, 1, 1, 2) * 2)
        for i in range(1, 11)
    ]
    return RunRecord("async (max_staleness=2)", {"max_staleness": 2, "engines": 2}, steps)


def empty_run():
    return RunRecord("crashed", {"max_staleness": 1}, [])


# ---------------------------------------------------------------------------- summarize


def test_summarize_computes_each_figure_from_the_steps():
    assert summarize(async_run()) == pytest.approx(
        {
            "steps": 10,
            "samples": 80,
            "reward_start": 0.15,
            "reward_end": 1.05,
            "wall_seconds": 10.0,
            "samples_per_s": 8.0,
            "step_seconds": 1.0,
            "generate_seconds": 1.0,
            "wait_seconds": 0.0,
            "train_seconds": 0.75,
            "sync_seconds": 0.25,
            "sync_share": 0.25,
            "dispatch_seconds": 0.0,
            "put_seconds": 0.0,
            "get_seconds": 0.0,
            "optimize_seconds": 0.0,
            "rest_share": 0.0,
            "staleness_mean": 1.0,
            "staleness_max": 2,
        }
    )
    # steps of 1 s with 0.6 s training and 0.25 s sync: 15% of a step is the driver's own,
    # the requests an update let go and the batch's put among it; the ranks' get and
    # optimizer step are parts of training
    slower = [
        step(
            i,
            wall=1.0 * i,
            reward=0.5,
            wait=0.0,
            train_seconds=0.6,
            dispatch_seconds=0.1,
            put_seconds=0.04,
            get_seconds=0.02 * i,
            optimize_seconds=0.5,
        )
        for i in (1, 2, 3)
    ]
    figures = summarize(RunRecord("r", {}, slower))
    assert figures["rest_share"] == pytest.approx(0.15)
    assert figures["dispatch_seconds"] == pytest.approx(0.1)
    assert figures["put_seconds"] == pytest.approx(0.04)
    assert figures["get_seconds"] == pytest.approx(0.05)  # steps 2 and 3
    assert figures["optimize_seconds"] == pytest.approx(0.5)
    assert figures["sync_share"] == pytest.approx(0.25)


def test_the_step_and_its_phases_are_read_over_the_steps_after_the_first():
    """A first step of 10 s (a compile, the engines' first batch) moves the wall time and
    samples/s, not the step's time or the shares of its phases."""
    steps = [step(1, wall=10.0, reward=0.5, sync_seconds=5.0)]
    steps += [step(i, wall=9.0 + i, reward=0.5, wait=0.0) for i in range(2, 6)]
    figures = summarize(RunRecord("r", {}, steps))
    assert figures["wall_seconds"] == 14.0 and figures["samples_per_s"] == pytest.approx(40 / 14)
    assert figures["step_seconds"] == pytest.approx(1.0)
    assert figures["sync_seconds"] == pytest.approx(0.25)
    assert figures["sync_share"] == pytest.approx(0.25)
    assert figures["rest_share"] == pytest.approx(0.0)


def test_reward_start_and_end_average_the_first_and_last_tenth_of_the_steps():
    twenty = RunRecord("r", {}, [step(i, wall=i, reward=i / 20) for i in range(1, 21)])
    figures = summarize(twenty)
    assert figures["reward_start"] == pytest.approx((0.05 + 0.10) / 2)
    assert figures["reward_end"] == pytest.approx((0.95 + 1.00) / 2)
    one = RunRecord("r", {}, [step(1, wall=1.0, reward=0.3)])
    assert summarize(one)["reward_start"] == summarize(one)["reward_end"] == 0.3


def test_staleness_comes_from_the_steps_own_figures_when_no_lags_were_recorded():
    steps = [
        step(1, wall=1.0, reward=0, lags=(), samples=10, staleness_mean=1.0, staleness_max=2),
        step(2, wall=2.0, reward=0, lags=(), samples=30, staleness_mean=3.0, staleness_max=5),
    ]
    figures = summarize(RunRecord("r", {}, steps))
    assert figures["staleness_mean"] == pytest.approx((10 * 1.0 + 30 * 3.0) / 40)
    assert figures["staleness_max"] == 5


def test_a_run_without_steps_sums_to_zero_steps_and_nan_figures():
    figures = summarize(empty_run())
    assert figures["steps"] == figures["samples"] == 0
    assert set(figures) == set(summarize(sync_run()))
    assert all(math.isnan(v) for k, v in figures.items() if k not in ("steps", "samples"))


# ---------------------------------------------------------------------------- progress


def test_format_progress_gives_short_strings_with_phases_in_ms_or_s():
    s = step(3, wall=9.0, reward=0.4567, lags=(0, 1, 3), samples_per_s=12.345)
    s.generate_seconds, s.wait_seconds, s.train_seconds, s.sync_seconds = 2.5, 0.0421, 12.34, 1.0
    assert format_progress(s) == {
        "reward": "0.457",
        "stale": "1.3/3",
        "samples/s": "12.3",
        "gen": "2.50s",
        "wait": "42ms",
        "train": "12.3s",
        "sync": "1.00s",
    }


# ---------------------------------------------------------------------------- write_report


@pytest.fixture
def mpl():
    return pytest.importorskip("matplotlib")


def assert_pngs(out):
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 1000, name


def test_write_report_writes_report_md_the_four_plots_and_runs_json(mpl, tmp_path):
    out = tmp_path / "made" / "here"
    path = write_report(out, [sync_run(), async_run()])
    assert path == out / "report.md" and path.is_file()
    assert_pngs(out)
    assert (out / "runs.json").is_file()


def test_report_table_holds_each_runs_figures_side_by_side(mpl, tmp_path):
    text = write_report(tmp_path, [sync_run(), async_run()]).read_text()
    assert text.startswith("# rlferry demo: 2 runs\n")
    for row in (
        "| figure | sync | async (max_staleness=2) |",
        "| steps | 10 | 10 |",
        "| samples trained | 80 | 80 |",
        "| reward at the start (mean, first 10% of steps) | 0.100 | 0.150 |",
        "| reward at the end (mean, last 10% of steps) | 1.000 | 1.050 |",
        "| wall time (s) | 20.0 | 10.0 |",
        "| samples/s | 4.0 | 8.0 |",
        "| wall time per step, steps 2 on (s) | 2.000 | 1.000 |",
        "| generate: engines busy (s per step, steps 2 on) | 1.000 | 1.000 |",
        "| wait for rollouts (s per step, steps 2 on) | 1.000 | 0.000 |",
        "| train (s per step, steps 2 on) | 0.750 | 0.750 |",
        "| weight sync (s per step, steps 2 on) | 0.250 | 0.250 |",
        "| weight-sync share of a step, steps 2 on (%) | 12.5 | 25.0 |",
        "| staleness mean (versions) | 0.00 | 1.00 |",
        "| staleness max (versions) | 0 | 2 |",
    ):
        assert row + "\n" in text, row


def test_report_says_how_much_faster_the_faster_of_two_runs_was(mpl, tmp_path):
    text = write_report(tmp_path, [sync_run(), async_run()]).read_text()
    assert (
        "**async (max_staleness=2)** was 2.00x as fast as **sync** in wall time for steps 2 "
        "to 10 (9.0 s against 18.0 s; the first step, with one-off costs, took 2.0 s and 1.0 s)."
        in text
    )


def test_the_speed_up_compares_the_steps_both_runs_ran(mpl, tmp_path):
    longer = sync_run()
    longer.steps += [step(i, wall=2.0 * i, reward=0.5) for i in range(11, 16)]
    text = write_report(tmp_path, [longer, async_run()]).read_text()
    assert "in wall time for steps 2 to 10 (9.0 s against 18.0 s; " in text


def test_report_embeds_each_plot_by_a_relative_link(mpl, tmp_path):
    text = write_report(tmp_path, [sync_run(), async_run()]).read_text()
    for name in PLOTS:
        assert f"]({name})" in text, name
    assert "[runs.json](runs.json)" in text


def test_report_lists_the_runs_settings_side_by_side(mpl, tmp_path):
    text = write_report(tmp_path, [sync_run(), async_run()]).read_text()
    assert "| setting | sync | async (max_staleness=2) |\n" in text
    assert "| `max_staleness` | 0 | 2 |\n" in text
    assert "| `lr` | 1e-05 | - |\n" in text  # a setting only one run has


def test_a_figure_the_summary_holds_wins_and_its_other_numbers_get_rows(mpl, tmp_path):
    run = async_run()
    run.summary = {"wall_seconds": 12.5, "gpu_idle_share": 0.3125, "note": "text is no figure"}
    text = write_report(tmp_path, [run]).read_text()
    assert "| wall time (s) | 12.5 |\n" in text
    assert "| `gpu_idle_share` | 0.3125 |\n" in text
    assert "note" not in text


def test_the_engines_lost_get_a_section_naming_the_step_why_and_the_rejoin(mpl, tmp_path):
    run = async_run()
    run.summary = {"engines lost": 2, "engine_losses": [
        {"engine": "engine0", "step": 3, "why": "its process (pid 7) exited with code -9",
         "lost_seconds": 2.25, "rejoined_step": 5, "rejoined_seconds": 6.5, "failed": None},
        {"engine": "engine1", "step": 8, "why": "its process (pid 8) exited with code -9",
         "lost_seconds": 9.0, "rejoined_step": None, "rejoined_seconds": None,
         "failed": "its 3 replacements are used up"},
    ]}  # fmt: skip
    text = write_report(tmp_path, [run]).read_text()
    assert "| `engines lost` | 2 |\n" in text
    assert "## Engines lost\n" in text
    assert (
        "| async (max_staleness=2) | `engine0` | 3 | 2.2 | its process (pid 7) exited with "
        "code -9 | 5 | 6.5 |\n"
    ) in text
    assert (
        "| async (max_staleness=2) | `engine1` | 8 | 9.0 | its process (pid 8) exited with "
        "code -9; its 3 replacements are used up | - | - |\n"
    ) in text
    assert read_runs(tmp_path / "runs.json")[0].summary == run.summary


def test_a_run_without_lost_engines_has_no_such_section(mpl, tmp_path):
    assert "Engines lost" not in write_report(tmp_path, [async_run()]).read_text()


def test_a_run_name_with_a_pipe_does_not_break_the_tables(mpl, tmp_path):
    run = sync_run()
    run.name = "sync | seed 1"
    text = write_report(tmp_path, [run]).read_text()
    assert "| figure | sync \\| seed 1 |\n" in text


def test_one_run_is_reported_without_a_speed_up(mpl, tmp_path):
    text = write_report(tmp_path, [async_run()]).read_text()
    assert text.startswith("# rlferry demo: async (max_staleness=2)\n")
    assert "| steps | 10 |\n" in text
    assert "as fast as" not in text
    assert_pngs(tmp_path)


def test_a_run_with_zero_steps_is_reported_as_such_beside_another(mpl, tmp_path):
    text = write_report(tmp_path, [sync_run(), empty_run()]).read_text()
    assert "**crashed** recorded no steps: it has no figures or plots." in text
    assert "| steps | 10 | 0 |\n" in text
    assert "| reward at the end (mean, last 10% of steps) | 1.000 | - |\n" in text
    assert "as fast as" not in text
    assert_pngs(tmp_path)


def test_a_lone_run_with_zero_steps_still_gets_a_report_and_plots(mpl, tmp_path):
    text = write_report(tmp_path, [empty_run()]).read_text()
    assert "**crashed** recorded no steps" in text
    assert "| wall time (s) | - |\n" in text
    assert_pngs(tmp_path)


def test_all_lags_zero_is_a_single_bar_not_an_error(mpl, tmp_path):
    text = write_report(tmp_path, [sync_run()]).read_text()
    assert "| staleness max (versions) | 0 |\n" in text
    assert_pngs(tmp_path)


def test_runs_json_reads_back_into_the_same_records(mpl, tmp_path):
    runs = [sync_run(), async_run(), empty_run()]
    runs[1].summary = summarize(runs[1])
    write_report(tmp_path, runs)
    assert read_runs(tmp_path / "runs.json") == runs


def test_runs_json_is_strict_json_with_nan_as_null(mpl, tmp_path):
    import json

    run = empty_run()
    run.summary = summarize(run)
    write_report(tmp_path, [run])
    text = (tmp_path / "runs.json").read_text()
    assert "NaN" not in text
    assert json.loads(text)[0]["summary"]["reward_end"] is None


def test_write_report_needs_a_run(tmp_path):
    with pytest.raises(ValueError, match=r"^write_report: expected at least one run, got none$"):
        write_report(tmp_path, [])


def test_write_report_without_matplotlib_names_the_extra_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'rlferry\[demo\]'$"):
        write_report(tmp_path / "out", [sync_run()])
    assert not (tmp_path / "out").exists()


def test_write_report_leaves_pyplot_and_its_backend_alone(mpl, tmp_path):
    code = (
        "import sys, matplotlib\n"
        "from rlferry.rl.report import RunRecord, StepRecord\n"
        "from rlferry.rl.report import write_report\n"
        "raw = lambda: dict.__getitem__(matplotlib.rcParams, 'backend')\n"
        "before = raw()\n"
        "s = StepRecord(1, 1.0, 0.5, 1.0, 2, 2.0, 0.5, 1, 0.5, 0.1, 0.3, 0.1, 0.2, [0, 1])\n"
        f"write_report({str(tmp_path)!r}, [RunRecord('r', {{}}, [s])])\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'\n"
        "assert raw() == before, (before, raw())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert (tmp_path / "report.md").is_file()
