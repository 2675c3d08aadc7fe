"""The demo report's plots (``reward_by_step.png``, ``reward_by_time.png``,
``phases.png``, ``staleness.png``), each drawn on its own ``Figure`` with the Agg canvas,
so pyplot's state and its backend stay as the caller left them. They need matplotlib
(``pip install 'rlferry[demo]'``), imported when a plot is drawn."""

from __future__ import annotations

import itertools
import textwrap
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._records import RunRecord

__all__ = ["matplotlib_classes", "plot_phases", "plot_reward", "plot_staleness"]

_DPI = 110
_PHASE_COLORS = {  # the trainer's step, bottom to top
    "wait_seconds": ("waiting for rollouts", "#bdbdbd"),
    "train_seconds": ("training", "#4c72b0"),
    "sync_seconds": ("weight sync", "#dd8452"),
    "other": ("other (step time not in a phase)", "#e5d8bd"),
}


def matplotlib_classes() -> tuple[Any, Any]:
    """``Figure`` and ``FigureCanvasAgg``, or an ImportError naming the extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "rlferry.rl.report needs matplotlib for its plots: pip install 'rlferry[demo]'"
        ) from None
    return Figure, FigureCanvasAgg


def _figure(rows: int, size: tuple[float, float], **share: Any) -> tuple[Any, list[Any]]:
    Figure, FigureCanvasAgg = matplotlib_classes()
    fig = Figure(figsize=size, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, squeeze=False, **share)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_axisbelow(True)
    return fig, list(axes)


def _nothing(ax: Any, text: str, *, ticks: bool = False) -> None:
    """``text`` where a plot would be; no ticks, unless other axes share them."""
    if not ticks:
        ax.set_xticks([])
        ax.set_yticks([])
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4")


def _legend(fig: Any, axes: Sequence[Any], ncols: int = 0, title: str | None = None) -> None:
    """One legend for ``axes`` below them (never over the data), long labels wrapped."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(textwrap.fill(label, 60), handle)
    if not ncols:  # the runs side by side while they fit
        ncols = 1 if sum(len(k) for k in handles) > 70 else len(handles)
    fig.legend(
        handles.values(),
        handles.keys(),
        loc="outside lower center",
        ncols=ncols,
        title=title,
        title_fontsize="small",
    )


def _integers() -> Any:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _smooth(values: list[float]) -> list[float]:
    """A centered moving mean over about 10% of the values (fewer at the ends)."""
    n, half = len(values), round(len(values) / 20)
    out = []
    for i in range(n):
        window = values[max(0, i - half) : i + half + 1]
        out.append(sum(window) / len(window))
    return out


def plot_reward(path: Path, runs: Sequence[RunRecord], *, by_time: bool) -> None:
    fig, (ax,) = _figure(1, (7.5, 4.2))
    for i, run in enumerate(runs):
        if not run.steps:
            continue
        x = [s.wall if by_time else s.step for s in run.steps]
        y = [s.reward_mean for s in run.steps]
        color = f"C{i % 10}"
        ax.plot(x, y, "o", ms=3.5, alpha=0.3, color=color, markeredgewidth=0)
        ax.plot(x, _smooth(y), color=color, lw=2, label=run.name)
    if any(r.steps for r in runs):
        _legend(fig, [ax], title="lines: moving mean, dots: each step")
    else:
        _nothing(ax, "no steps recorded")
    what = "wall time" if by_time else "training step"
    if by_time:
        ax.set_xlim(left=0)
    elif any(r.steps for r in runs):
        ax.xaxis.set_major_locator(_integers())
    ax.set_title(f"Mean reward by {what}")
    ax.set_xlabel("wall time since the run started (s)" if by_time else "training step")
    ax.set_ylabel("mean reward of the step's samples")
    fig.savefig(path)


def plot_phases(path: Path, runs: Sequence[RunRecord]) -> None:
    fig, axes = _figure(len(runs), (8.0, 0.9 + 2.7 * len(runs)), sharex=True, sharey=True)
    firsts: list[tuple[Any, int, float]] = []  # each run's axes, first step and its height
    later: list[float] = []  # the other steps' heights
    for ax, run in zip(axes, runs, strict=True):
        ax.set_title(run.name, fontsize="medium")
        ax.set_ylabel("seconds")
        if not run.steps:
            _nothing(ax, "no steps recorded", ticks=any(r.steps for r in runs))
            continue
        x = [s.step for s in run.steps]
        phases = {key: [getattr(s, key) for s in run.steps] for key in list(_PHASE_COLORS)[:3]}
        starts = [0.0] + [s.wall for s in run.steps[:-1]]
        phases["other"] = [
            max(0.0, s.wall - start - s.wait_seconds - s.train_seconds - s.sync_seconds)
            for s, start in zip(run.steps, starts, strict=True)
        ]
        width = 0.8 * min((b - a for a, b in itertools.pairwise(x)), default=1)
        bottom = [0.0] * len(x)
        for key, values in phases.items():
            if not any(values):
                continue
            label, color = _PHASE_COLORS[key]
            ax.bar(x, values, width, bottom=bottom, color=color, label=label, linewidth=0)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        gen = [s.generate_seconds for s in run.steps]
        ax.plot(x, gen, color="black", lw=1.2, marker="o", ms=2.5, label="engines generating")
        firsts.append((ax, x[0], max(bottom[0], gen[0])))
        later += [max(b, g) for b, g in zip(bottom[1:], gen[1:], strict=True)]
    _cut_first(firsts, later)
    axes[-1].set_xlabel("training step")
    axes[-1].xaxis.set_major_locator(_integers())
    _legend(fig, axes, ncols=3)
    fig.suptitle("Where the time goes: seconds of each step", fontsize="large")
    fig.savefig(path)


def _cut_first(firsts: list[tuple[Any, int, float]], later: list[float]) -> None:
    """A first step over 3x the highest other (its one-off costs) would flatten every other
    bar: the axes end a little above the others, the first bar is cut there and labelled
    with its seconds."""
    if not later or max(h for _, _, h in firsts) <= 3 * max(later):
        return
    top = 1.3 * max(later)
    for ax, x0, height in firsts:
        ax.set_ylim(0, top)
        if height > top:
            ax.annotate(f"{height:.1f} s", (x0, top), xytext=(4, -12), textcoords="offset points",
                        fontsize="small")  # fmt: skip


def plot_staleness(path: Path, runs: Sequence[RunRecord]) -> None:
    fig, (ax,) = _figure(1, (7.5, 4.2))
    lagged = [(i, r, [lag for s in r.steps for lag in s.lags]) for i, r in enumerate(runs)]
    lagged = [(i, r, lags) for i, r, lags in lagged if lags]
    width = 0.8 / max(1, len(lagged))
    top = 0
    for j, (i, run, lags) in enumerate(lagged):
        counts = Counter(lags)
        x = [lag - 0.4 + width * (j + 0.5) for lag in sorted(counts)]
        y = [100 * counts[lag] / len(lags) for lag in sorted(counts)]
        mean = sum(lags) / len(lags)
        label = f"{run.name}: {len(lags)} samples, mean {mean:.2f}"
        bars = ax.bar(x, y, width, color=f"C{i % 10}", label=label, linewidth=0)
        if len(counts) <= 12:
            ax.bar_label(bars, fmt="%.0f%%", fontsize="small", padding=2)
        top = max(top, max(lags))
    if lagged:
        _legend(fig, [ax])
        ax.set_xlim(-0.6, max(top, 1) + 0.6)
        ax.set_ylim(0, 108)  # room for the label of a bar of 100%
        ax.set_yticks(range(0, 101, 20))
        ax.xaxis.set_major_locator(_integers())
    else:
        _nothing(ax, "no lags recorded")
    ax.set_title("Staleness of every trained sample")
    ax.set_xlabel("lag (versions the trainer was past the sample's weights)")
    ax.set_ylabel("share of trained samples (%)")
    fig.savefig(path)
