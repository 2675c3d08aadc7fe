"""``rlferry demo``, the command: its settings from the command line, one run (or, with
``--compare``, synchronous then asynchronous) under a progress bar each, and the report."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from rlferry.errors import RequestError

from ._config import DemoConfig
from .demo import run_demo
from .report import RunRecord, StepRecord

__all__ = ["main"]


def main(args: Any) -> Path:
    """``rlferry demo``: one run (or, with ``--compare``, synchronous then asynchronous),
    a progress bar per run, the report in ``--out``; returns the report's path."""
    # the demo's bars only: transformers' loading and saving bars (read by huggingface_hub
    # when first imported, here and in the processes the demo starts) would cut into them
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    from .report import write_report

    base = DemoConfig(
        steps=args.steps, engines=args.engines, max_staleness=args.max_staleness,
        device=args.device, engine=args.engine, layout=args.layout, model=args.model,
        seed=args.seed, sync=not args.no_sync, launcher=args.launcher,
        ray_address=args.ray_address, lora=getattr(args, "lora", None), out=args.out,
        checkpoint_every=args.checkpoint_every, checkpoint_dir=args.checkpoint_dir,
        resume=args.resume, groups_per_step=getattr(args, "groups_per_step", 0),
    )  # fmt: skip
    configs = [base]
    if args.compare:
        if args.checkpoint_every is not None or args.resume is not None:
            raise RequestError(
                "compare: runs two jobs; --checkpoint-every and --resume take one (drop "
                "--compare, or them)"
            )
        asynchronous = (
            base if base.max_staleness > 0 else dataclasses.replace(base, max_staleness=2)
        )  # each run's trained.jsonl in OUT/sync and OUT/async
        configs = [
            dataclasses.replace(base, max_staleness=0, out=str(Path(args.out) / "sync")),
            dataclasses.replace(asynchronous, out=str(Path(args.out) / "async")),
        ]
    runs = [_one_run(config) for config in configs]
    return write_report(Path(args.out), runs)


def _one_run(config: DemoConfig) -> RunRecord:
    """``config``'s run under a progress bar, its summary computed."""
    from tqdm import tqdm

    from .report import format_progress, summarize

    with tqdm(total=config.steps, desc=config.name, unit="step", dynamic_ncols=True) as bar:

        def progress(row: StepRecord) -> None:
            bar.set_postfix(format_progress(row), refresh=False)
            bar.update(row.step - bar.n)  # a resumed run's bar starts at its step

        run = run_demo(config, progress)
    if why := run.summary.get("gpu_busy_why"):
        print(f"rlferry demo: the GPU busy share was not measured: {why}", file=sys.stderr)
    run.summary = {**summarize(run), **{k: v for k, v in run.summary.items()
                                         if isinstance(v, (int, float))
                                         or k == "engine_losses"}}  # fmt: skip
    return run
