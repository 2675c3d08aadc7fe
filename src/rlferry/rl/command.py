"""``rlferry demo``, the command: its settings from the command line, one run (or, with
``--compare``, synchronous then asynchronous) under a progress bar each, and the report."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import sys
from pathlib import Path
from typing import Any

from rlferry.errors import RequestError

from ._config import DemoConfig
from ._mps import mps_for, private_mps
from .demo import run_demo
from .report import RunRecord, StepRecord, write_report

__all__ = ["main"]

# seconds the child of an MPS run may take to stop its processes once Ctrl-C came
CHILD_STOP_BOUND = 120.0
# a synchronous run's MPS setting: its engines and ranks take turns on the GPU
SYNCHRONOUS = "off (a synchronous run: its processes take turns on the GPU)"


def main(args: Any) -> Path:
    """``rlferry demo``: one run (or, with ``--compare``, synchronous then asynchronous),
    a progress bar per run, the report in ``--out``; returns the report's path. Colocated
    on CUDA an asynchronous run goes under NVIDIA MPS (:mod:`._mps`), in a child process
    of its own; a synchronous one does not (its engines and ranks take turns on the GPU:
    nothing runs side by side, and MPS made its step slower)."""
    # the demo's bars only: transformers' loading and saving bars (read by huggingface_hub
    # when first imported, here and in the processes the demo starts) would cut into them
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    configs = _configs(args)
    base = configs[-1]
    mps = mps_for(base.device, base.layout, base.launcher, args.no_mps)
    if mps is None:
        return _runs(configs, args.out)
    if not mps.start:
        if not mps.on:
            print(f"rlferry demo: MPS {mps.why}", file=sys.stderr)
        return _runs([dataclasses.replace(c, mps=mps.why) for c in configs], args.out)
    plain = [dataclasses.replace(c, mps=SYNCHRONOUS) for c in configs if c.max_staleness == 0]
    shared = [c for c in configs if c.max_staleness > 0]
    if not shared:
        return _runs(plain, args.out)
    # a child of its own: its CUDA context is gone before the daemon starts
    records = _in_child(plain, {}) if plain else []
    with private_mps() as mps:
        shared = [dataclasses.replace(c, mps=mps.why) for c in shared]
        if not mps.on:
            print(f"rlferry demo: MPS {mps.why}; the run goes on without it", file=sys.stderr)
            records += [_one_run(c) for c in shared]
        else:
            records += _in_child(shared, mps.env)
    return write_report(Path(args.out), records)


def _configs(args: Any) -> list[DemoConfig]:
    """The runs' settings from the command line (checked: a wrong one raises here)."""
    base = DemoConfig(
        steps=args.steps, engines=args.engines, max_staleness=args.max_staleness,
        device=args.device, engine=args.engine, layout=args.layout, model=args.model,
        seed=args.seed, sync=not args.no_sync, launcher=args.launcher,
        ray_address=args.ray_address, lora=getattr(args, "lora", None), out=args.out,
        checkpoint_every=args.checkpoint_every, checkpoint_dir=args.checkpoint_dir,
        resume=args.resume, groups_per_step=getattr(args, "groups_per_step", 0),
    )  # fmt: skip
    if not args.compare:
        return [base]
    if args.checkpoint_every is not None or args.resume is not None:
        raise RequestError(
            "compare: runs two jobs; --checkpoint-every and --resume take one (drop "
            "--compare, or them)"
        )
    asynchronous = (
        base if base.max_staleness > 0 else dataclasses.replace(base, max_staleness=2)
    )  # each run's trained.jsonl in OUT/sync and OUT/async
    return [
        dataclasses.replace(base, max_staleness=0, out=str(Path(args.out) / "sync")),
        dataclasses.replace(asynchronous, out=str(Path(args.out) / "async")),
    ]


def _runs(configs: list[DemoConfig], out: str) -> Path:
    """Every run of ``configs``, one after the other, then the report."""
    return write_report(Path(out), [_one_run(config) for config in configs])


def _in_child(configs: list[DemoConfig], env: dict[str, str]) -> list[RunRecord]:
    """Every run of ``configs`` (:func:`_one_run`) in a child process whose environment
    holds ``env`` (the MPS daemon's address: its processes, and theirs, are its clients;
    this one stays out, so that the daemon can quit once the child has exited); their
    records. The child's error is told by the child; here its exit status: 130 (Ctrl-C)
    as ``KeyboardInterrupt``, another as ``SystemExit``."""
    ctx = mp.get_context("spawn")
    records, sent = ctx.Pipe(duplex=False)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # a spawned child's environment is this one's when it starts
    try:
        child = ctx.Process(target=_child_main, args=(configs, sent), name="rlferry-demo")
        child.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        sent.close()  # the child's end: the read below ends when the child's does
    runs: list[RunRecord] | None = None
    try:
        with contextlib.suppress(EOFError):  # the child ended without its records
            runs = records.recv()  # the runs' own length: every wait inside has its bound
        child.join()
    except KeyboardInterrupt:  # told to the child (a group of its own): it stops its processes
        if child.exitcode is None and child.pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(child.pid, signal.SIGINT)
        child.join(CHILD_STOP_BOUND)
        if child.exitcode is None:
            child.kill()
            child.join()
        raise
    finally:
        records.close()
    if child.exitcode == 130:
        raise KeyboardInterrupt
    if child.exitcode is not None and child.exitcode < 0:  # no word of its own came
        print(f"rlferry demo: the run's process was killed by signal {-child.exitcode}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(1)
    if child.exitcode:
        raise SystemExit(child.exitcode)
    if runs is None:
        raise SystemExit("rlferry demo: the run's process ended without its records")
    return runs


def _child_main(configs: list[DemoConfig], sent: Any) -> None:
    """The child of :func:`_in_child`: the runs, their records sent back, their errors
    told as ``rlferry demo`` tells them. Its process group is its own (its processes',
    too): a terminal's Ctrl-C reaches the command's process, which tells it once."""
    os.setpgid(0, 0)
    try:
        sent.send([_one_run(config) for config in configs])
    except ValueError as e:
        print(f"rlferry demo: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        sent.close()


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
