"""The demo's report: a run's figures (:func:`summarize`), a progress bar's strings
(:func:`format_progress`), and ``report.md`` with its plots (:func:`write_report`).

The plots need matplotlib (``pip install 'rlferry[demo]'``), imported only when a report is
written (``_plots.py`` draws them, each on its own ``Figure`` with the Agg canvas, so
pyplot's state and its backend stay as the caller left them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlferry.errors import RequestError

from ._plots import matplotlib_classes, plot_phases, plot_reward, plot_staleness
from ._records import RunRecord, StepRecord

__all__ = ["format_progress", "read_runs", "summarize", "write_report"]


def summarize(run: RunRecord) -> dict[str, float]:
    """A run's figures, computed from its steps.

    ``steps``, ``samples`` (trained); ``reward_start`` / ``reward_end``: the mean
    ``reward_mean`` of the first / last 10% of the steps (at least one step);
    ``wall_seconds``: at the end of the last step; ``samples_per_s``: samples over that.
    The step's time and its phases are read over the steps after the first (the first
    pays one-off costs: the engines' first batch, a compiled step's capture, the first
    push's plan; with one step, over it): ``step_seconds``: wall seconds per step;
    ``generate_seconds``, ``wait_seconds``, ``train_seconds``, ``sync_seconds``: the mean
    of each phase per step; ``sync_share``: weight sync's share of that wall time (0 to
    1); ``dispatch_seconds``: the driver starting the requests an update let go, per
    step; ``rest_share``: the share of it that is neither waiting for rollouts, training
    nor weight sync (the driver's own work: those requests, scoring, the queue's put);
    ``put_seconds`` (scoring and the put), ``get_seconds`` and ``optimize_seconds`` (the
    ranks' get and optimizer step, within training): the mean per step;
    ``staleness_mean`` /
    ``staleness_max``: over every trained sample's lag (over the steps' own figures where
    no step recorded its lags). A run without steps has 0 steps and samples and NaN for
    the rest.
    """
    steps = run.steps
    n = len(steps)
    samples = float(sum(s.samples for s in steps))
    if n == 0:
        nan = math.nan
        return {"steps": 0.0, "samples": 0.0} | dict.fromkeys(_FIGURES[2:], nan)
    k = max(1, math.ceil(n / 10))
    wall = steps[-1].wall
    timed = steps[1:] if n > 1 else steps  # the steps after the first: no one-off costs
    span = wall - steps[0].wall if n > 1 else wall
    m = len(timed)
    lags = [lag for s in steps for lag in s.lags]
    if lags:
        staleness_mean, staleness_max = sum(lags) / len(lags), float(max(lags))
    else:
        weights = [s.samples for s in steps] if samples else [1] * n
        weighted = sum(s.staleness_mean * w for s, w in zip(steps, weights, strict=True))
        staleness_mean = weighted / sum(weights)
        staleness_max = float(max(s.staleness_max for s in steps))
    return {
        "steps": float(n),
        "samples": samples,
        "reward_start": sum(s.reward_mean for s in steps[:k]) / k,
        "reward_end": sum(s.reward_mean for s in steps[-k:]) / k,
        "wall_seconds": wall,
        "samples_per_s": samples / wall if wall > 0 else math.nan,
        "step_seconds": span / m,
        "generate_seconds": sum(s.generate_seconds for s in timed) / m,
        "wait_seconds": sum(s.wait_seconds for s in timed) / m,
        "train_seconds": sum(s.train_seconds for s in timed) / m,
        "sync_seconds": sum(s.sync_seconds for s in timed) / m,
        "sync_share": sum(s.sync_seconds for s in timed) / span if span > 0 else math.nan,
        "dispatch_seconds": sum(s.dispatch_seconds for s in timed) / m,
        "put_seconds": sum(s.put_seconds for s in timed) / m,
        "get_seconds": sum(s.get_seconds for s in timed) / m,
        "optimize_seconds": sum(s.optimize_seconds for s in timed) / m,
        "rest_share": (
            1 - sum(s.wait_seconds + s.train_seconds + s.sync_seconds for s in timed) / span
            if span > 0
            else math.nan
        ),
        "staleness_mean": staleness_mean,
        "staleness_max": staleness_max,
    }


def format_progress(step: StepRecord) -> dict[str, str]:
    """Short strings of one step for a tqdm postfix (``bar.set_postfix(format_progress(s))``):
    reward, staleness (mean/max), samples/s and the four phases (``850ms``, ``1.25s``)."""
    return {
        "reward": f"{step.reward_mean:.3f}",
        "stale": f"{step.staleness_mean:.1f}/{step.staleness_max}",
        "samples/s": f"{step.samples_per_s:.1f}",
        "gen": _duration(step.generate_seconds),
        "wait": _duration(step.wait_seconds),
        "train": _duration(step.train_seconds),
        "sync": _duration(step.sync_seconds),
    }


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.1f}s"


def read_runs(path: str | Path) -> list[RunRecord]:
    """The runs a report's ``runs.json`` holds, to write the report again."""
    out = []
    for run in json.loads(Path(path).read_text()):
        steps = [StepRecord(**s) for s in run["steps"]]
        out.append(RunRecord(run["name"], run["config"], steps, run["summary"]))
    return out


def write_report(out_dir: str | Path, runs: Sequence[RunRecord]) -> Path:
    """Write ``report.md``, its plots (``reward_by_step.png``, ``reward_by_time.png``,
    ``phases.png``, ``staleness.png``) and ``runs.json`` (the records, for
    :func:`read_runs`) into ``out_dir`` (made if missing); returns the path of
    ``report.md``. A figure a run's ``summary`` holds is shown as recorded there, over
    the one :func:`summarize` computes; the summary's other numbers get rows of their own.

    Raises:
        ValueError: no runs.
        ImportError: matplotlib is not installed (``pip install 'rlferry[demo]'``).
    """
    if not runs:
        raise RequestError("write_report: expected at least one run, got none")
    matplotlib_classes()  # before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = [json.dumps(_finite(asdict(r)), default=str) for r in runs]  # a line a run
    (out / "runs.json").write_text("[\n" + ",\n".join(records) + "\n]\n")
    plot_reward(out / "reward_by_step.png", runs, by_time=False)
    plot_reward(out / "reward_by_time.png", runs, by_time=True)
    plot_phases(out / "phases.png", runs)
    plot_staleness(out / "staleness.png", runs)
    path = out / "report.md"
    path.write_text(_markdown(runs))
    return path


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None, so ``runs.json`` is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


# ---------------------------------------------------------------------------- report.md

_FIGURES = (  # summarize's keys, in its table's order
    "steps",
    "samples",
    "reward_start",
    "reward_end",
    "wall_seconds",
    "samples_per_s",
    "step_seconds",
    "generate_seconds",
    "wait_seconds",
    "put_seconds",
    "train_seconds",
    "get_seconds",
    "optimize_seconds",
    "sync_seconds",
    "sync_share",
    "dispatch_seconds",
    "rest_share",
    "staleness_mean",
    "staleness_max",
)
_ROWS: dict[str, tuple[str, Callable[[float], str]]] = {
    "steps": ("steps", "{:.0f}".format),
    "samples": ("samples trained", "{:.0f}".format),
    "reward_start": ("reward at the start (mean, first 10% of steps)", "{:.3f}".format),
    "reward_end": ("reward at the end (mean, last 10% of steps)", "{:.3f}".format),
    "wall_seconds": ("wall time (s)", "{:.1f}".format),
    "samples_per_s": ("samples/s", "{:.1f}".format),
    "step_seconds": ("wall time per step, steps 2 on (s)", "{:.3f}".format),
    "generate_seconds": ("generate: engines busy (s per step, steps 2 on)", "{:.3f}".format),
    "wait_seconds": ("wait for rollouts (s per step, steps 2 on)", "{:.3f}".format),
    "put_seconds": ("score and put the batch (s per step, steps 2 on)", "{:.3f}".format),
    "train_seconds": ("train (s per step, steps 2 on)", "{:.3f}".format),
    "get_seconds": ("train: the ranks' get (s per step, steps 2 on)", "{:.3f}".format),
    "optimize_seconds": (
        "train: the ranks' optimizer step (s per step, steps 2 on)",
        "{:.3f}".format,
    ),
    "sync_seconds": ("weight sync (s per step, steps 2 on)", "{:.3f}".format),
    "sync_share": ("weight-sync share of a step, steps 2 on (%)", lambda v: f"{v * 100:.1f}"),
    "dispatch_seconds": (
        "starting the requests an update let go (s per step, steps 2 on)",
        "{:.3f}".format,
    ),
    "rest_share": (
        "the rest: neither waiting, training nor sync (% of a step, steps 2 on; the put among it)",
        lambda v: f"{v * 100:.1f}",
    ),
    "staleness_mean": ("staleness mean (versions)", "{:.2f}".format),
    "staleness_max": ("staleness max (versions)", "{:.0f}".format),
}


def _markdown(runs: Sequence[RunRecord]) -> str:
    names = [_escape(r.name) for r in runs]
    figures = [_figures(r) for r in runs]
    keys = list(_FIGURES) + [k for f in figures for k in f if k not in _ROWS]
    title = "rlferry demo: " + (names[0] if len(runs) == 1 else f"{len(runs)} runs")
    lines = [f"# {title}", "", _row(["figure", *names]), _row(["---"] + ["---:"] * len(runs))]
    for key in dict.fromkeys(keys):
        label, fmt = _ROWS.get(key, (f"`{key}`", _number))
        cells = [fmt(f[key]) if math.isfinite(f.get(key, math.nan)) else "-" for f in figures]
        lines.append(_row([label, *cells]))
    lines.append("")
    for run in runs:
        if not run.steps:
            lines += [f"**{_escape(run.name)}** recorded no steps: it has no figures or plots.", ""]
    speedup = _speedup(runs)
    if speedup:
        lines += [speedup, ""]
    lines += [
        "## Reward",
        "",
        "Each step's mean reward (dots) and its moving mean over about 10% of the steps (line).",
        "",
        "![Reward by training step](reward_by_step.png)",
        "",
        "![Reward by wall time](reward_by_time.png)",
        "",
        "## Where the time goes",
        "",
        "Bars: the trainer's step, from the end of the one before (waiting for rollouts, "
        "training, weight sync, the rest). Line: the engines' generating time in that step "
        "(summed over the engines, divided by their number); where the line rises above "
        "the grey, the engines generated while the trainer worked. A first step far longer "
        "than the others (its one-off costs) is cut at the top, labelled with its seconds.",
        "",
        "![Seconds per phase of each step](phases.png)",
        "",
        "## Staleness",
        "",
        "Every trained sample's lag: how many versions the trainer was past the weights "
        "that generated it.",
        "",
        "![Staleness of the trained samples](staleness.png)",
        "",
        *_losses(runs),
        "## Settings",
        "",
        *_settings(runs),
        "",
        "The records: [runs.json](runs.json) (`rlferry.rl.report.read_runs` reads them back).",
        "",
    ]
    return "\n".join(lines)


def _figures(run: RunRecord) -> dict[str, float]:
    figures = summarize(run)
    for key, value in run.summary.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            figures[key] = float(value)
    return figures


def _losses(runs: Sequence[RunRecord]) -> list[str]:
    """The section of the engines lost during the runs (none: no section): which engine,
    at which step, why, and when its replacement joined (the summary's ``engine_losses``)."""
    rows = [(r.name, x) for r in runs for x in r.summary.get("engine_losses", ())]
    if not rows:
        return []
    lines = [
        "## Engines lost",
        "",
        "Each engine lost during the run; its replacement (a new process, or the actor Ray "
        "restarted) joined under the same name and got rollouts once it held a version "
        "within the staleness bound. Its requests in flight went on on the other engines.",
        "",
        _row(["run", "engine", "lost in step", "at (s)", "why", "rejoined in step", "at (s)"]),
        _row(["---", "---", "---:", "---:", "---", "---:", "---:"]),
    ]
    for name, x in rows:
        back = x.get("rejoined_step")
        lines.append(_row([
            _escape(name), f"`{x['engine']}`", str(x["step"]), f"{x['lost_seconds']:.1f}",
            _escape(x["why"] + (f"; {x['failed']}" if x.get("failed") else "")),
            "-" if back is None else str(back),
            "-" if back is None else f"{x['rejoined_seconds']:.1f}",
        ]))  # fmt: skip
    return [*lines, ""]


def _speedup(runs: Sequence[RunRecord]) -> str | None:
    """With two runs: how much less wall time the faster took for the steps both ran after
    the first (which pays one-off costs: the engines' first batch, the plan's first push)."""
    if len(runs) != 2:
        return None
    k = min(len(r.steps) for r in runs)
    if k < 2:
        return None
    (fast_t, fast), (slow_t, slow) = sorted(
        (r.steps[k - 1].wall - r.steps[0].wall, r.name) for r in runs
    )
    if fast_t <= 0:
        return None
    first = " and ".join(f"{r.steps[0].wall:.1f} s" for r in runs)
    return (
        f"**{_escape(fast)}** was {slow_t / fast_t:.2f}x as fast as **{_escape(slow)}** "
        f"in wall time for steps 2 to {k} ({fast_t:.1f} s against {slow_t:.1f} s; the first "
        f"step, with one-off costs, took {first})."
    )


def _settings(runs: Sequence[RunRecord]) -> list[str]:
    keys = dict.fromkeys(k for r in runs for k in r.config)
    if not keys:
        return ["No settings recorded."]
    lines = [_row(["setting", *(_escape(r.name) for r in runs)]), _row(["---"] * (len(runs) + 1))]
    for key in keys:
        cells = [_setting(r.config[key]) if key in r.config else "-" for r in runs]
        lines.append(_row([f"`{key}`", *cells]))
    return lines


def _setting(value: Any) -> str:
    if isinstance(value, str):
        return _escape(value)
    if isinstance(value, float):
        return f"{value:g}"
    return _escape(json.dumps(value, default=str))


def _number(value: float) -> str:
    return f"{value:.0f}" if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
