"""``rlferry demo``: asynchronous GRPO end to end on the three planes.

The driver (this process) warm-starts a small model on the task, saves it, and starts:
``engines`` engine processes (``rlferry serve engine``, each an ``HFEngine``, or a
``VLLMEngine`` with ``engine="vllm"``), an embedded queue, and two trainer processes
(data parallel, ``torch.distributed``). Then,
every step:

1. a producer keeps the engines busy through the ``Coordinator`` (``submit`` waits,
   by event, while ``max_staleness`` would be exceeded);
2. the driver takes the step's finished GRPO groups (``Coordinator.batch``: none staler
   than ``max_staleness``), scores them, computes group-normalized advantages and puts
   them into the queue partition ``train_{step}`` (versions in the meta);
3. each trainer rank gets its whole groups (``GrpoGroups``), takes one optimizer step on
   the clipped GRPO loss, and acks;
4. the coordinator pauses the engines, every trainer rank pushes its own shards through
   its ``ShardedSender`` (shm on the CPU; on CUDA cuda_ipc beside the engines and NCCL
   from other GPUs; nothing is gathered), the engines commit once every rank's part
   loaded, resume. On one GPU trainer rank 0, the only rank, pushes through its
   ``WeightSender``; vLLM engines get the shards gathered to rank 0.

With ``max_staleness=0`` nothing generates while the trainer trains: synchronous RL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

from rlferry.control import Coordinator, Group, RemoteEngine, SamplingParams, rollout_columns
from rlferry.queue import Queue

from ._config import LORA_LR, RL_LR, WARM, DemoConfig
from ._gpu import GpuBusy
from ._memory import ENGINE_LEN, check_memory
from ._processes import (
    Processes,
    RayProcesses,
    call,
    free_port,
    start_engine,
    start_trainers,
)
from ._ranks import final_check, pusher
from ._records import RunRecord, StepRecord
from .faults import ENGINE_RESTARTS, Engines, generating, process_slots, ray_slots

__all__ = ["DemoConfig", "run_demo"]

_RUNS = itertools.count()  # a run's number in this process: its Ray job's name


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a future's outcome as heard (another error is told instead of it)."""
    if not future.cancelled():
        future.exception()


async def _run(config: DemoConfig, progress: Any = None) -> RunRecord:
    from .grpo import group_advantages
    from .model import make_model, warm_start
    from .task import ReverseTask

    task = ReverseTask()
    tok = task.tokenizer
    record = RunRecord(config.name, dataclasses.asdict(config))
    on_ray = config.launcher == "ray"
    procs: Any = RayProcesses(config.ray_address, f"demo-{os.getpid()}-{next(_RUNS)}") if (
        on_ray) else Processes()  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="rlferry-demo-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        check_memory(config, tok.vocab_size)
        # on CUDA the warm start runs on GPU 0 (bfloat16 for qwen3-0.6b), then leaves it
        where = "cuda:0" if config.device == "cuda" else "cpu"
        model = make_model(config.model, tok.vocab_size, seed=config.seed, device=where)
        warm_steps, warm_lr = WARM[config.model]
        if config.warm_steps is not None:
            warm_steps = config.warm_steps
        warm = warm_start(model, task, steps=warm_steps, seed=config.seed, lr=warm_lr)
        record.summary["warm_start_loss"] = [warm[0], warm[-1]] if warm else []
        model.save_pretrained(tmp)
        serve_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        del model
        if config.device == "cuda":
            torch.cuda.empty_cache()
        if config.device == "cpu":  # the run's processes share the cores: one thread each
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, threads)
        if on_ray:  # the queue's services as actors of the job, found by name
            stack.callback(procs.stop)
            queue = await asyncio.to_thread(procs.start_queue)
            if config.device == "cuda":
                await asyncio.to_thread(procs.place_gpus, config.gpus()[1], config.engines)
        else:  # the processes stop before the queue closes
            queue = stack.enter_context(Queue(storage_units=1, tasks=("train",)))
            stack.callback(procs.stop)
        engine_gpus, dp = config.gpus()
        settings = {
            "seed": config.seed, "device": config.device, "port": free_port(),
            "model_dir": tmp, "lr": _lr(config), "lora": config.lora,
            "clip": config.clip, "sync": config.sync,
            "engines": config.engines, "queue": None if on_ray else queue.address,
            "ray_job": procs.job if on_ray else None,
            "transport": "shm" if config.device == "cpu" else
                         "broadcast" if config.layout == "split" else "cuda_ipc",
            "dtype": serve_dtype, "dp": dp, "sharded": config.sharded(),
            "p2p": config.point_to_point(),
            "first_gpu": engine_gpus if config.layout == "split" else 0,
            "groups_per_step": config.groups_per_step, "group_size": config.group_size,
            # Ray sets OMP_NUM_THREADS=1 in an actor of a fractional CPU: on CUDA a trainer
            # actor then stepped in 0.32 s where a process takes 0.25 (one H100): it gets
            # the threads a process of its own would
            "threads": 1 if config.device == "cpu" else torch.get_num_threads() if on_ray else 0,
        }  # fmt: skip
        per_engine = -(-config.groups_per_step * config.group_size // config.engines)
        engines: list[Any]
        # The engines start while the trainers do.
        starting: asyncio.Future[Any]
        if on_ray:  # the engines as actors, driven over HTTP with the job's token
            starting = asyncio.ensure_future(asyncio.to_thread(
                procs.start_engines, tmp, config.engines, config.device, config.engine,
                max(64, per_engine), ENGINE_LEN, config.lora, ENGINE_RESTARTS,
            ))  # fmt: skip
        else:

            def start_one(i: int) -> str:
                return start_engine(procs, tmp, i, config.engine_device(i), config.engine,
                                    max(64, per_engine), ENGINE_LEN, config.lora)  # fmt: skip

            starting = asyncio.gather(
                *(asyncio.to_thread(start_one, i) for i in range(config.engines))
            )
        try:
            if on_ray:
                sender = await asyncio.to_thread(procs.start_trainers, settings)
            else:
                sender = await asyncio.to_thread(start_trainers, procs, settings)
        except BaseException:  # the trainers' error is the one to tell; the engines' waits
            starting.add_done_callback(_retrieved)
            raise
        started = await starting
        engines = started if on_ray else [
            RemoteEngine(url, name=f"engine{i}") for i, url in enumerate(started)
        ]  # fmt: skip
        if sender is not None:  # each engine told rank 0's address (point to point: its link)
            await asyncio.gather(*(
                e.init_weight_transfer("demo", at) for e, at in zip(engines, sender, strict=True)
            ))  # fmt: skip
        batch = config.groups_per_step * config.group_size
        coord = Coordinator(engines, batch_size=batch, max_staleness=config.max_staleness)
        start, ended = ray_slots(procs.engine_actors) if on_ray else process_slots(procs, start_one)
        slots = Engines(engines, start=start, ended=ended, weights=sender)
        slots.attach(coord)
        engines = slots.handles
        prompts: dict[int, Any] = {}
        params = SamplingParams(
            max_tokens=task.max_tokens, temperature=1.0, stop_token_ids=(tok.eos_id,)
        )

        async def produce() -> None:
            rng = random.Random(config.seed)
            for k in range(1 << 62):
                prompt = task.sample(1, rng)[0]
                prompts[k] = prompt
                await coord.submit(prompt.ids, params, n=config.group_size, group=k)

        # Everything made so far (torch, transformers, the model, the services) lives as long
        # as the run: out of the garbage collector's sight, a full collection scans only
        # what the steps make (without this: 130-290 ms pauses every ~8 steps here).
        gc.freeze()
        stack.callback(gc.unfreeze)
        producer = asyncio.ensure_future(produce())
        client = queue.async_client()
        ranks = [conn for _, conn in procs.trainers]
        sent: list[list[int]] = []  # per update, the bytes each trainer rank pushed
        if config.sync:  # how a replacement is caught up when no engine serves
            slots.push_at = lambda version: pusher(ranks, version, sent)
        t_start = time.monotonic()
        # NVML's samples of the run's GPUs (on Ray they are Ray's to place: not measured)
        gpus = GpuBusy(range(engine_gpus + dp if config.layout == "split" else dp)) if (
            config.device == "cuda" and not on_ray) else None  # fmt: skip
        if gpus is not None:
            stack.callback(gpus.close)

        async def recorded(row: StepRecord, busy: list[Any], asked: Any) -> list[Any]:
            """The engines' statistics asked for at ``row``'s end, once they came (they were
            asked for without waiting: an engine answers between its decode steps, so the
            answer took 11 ms of each CPU step when the step waited for it): ``row`` gets
            the engines' generating time since ``busy``, then is recorded."""
            now = await asked
            gen = generating(busy, now)
            row = dataclasses.replace(row, generate_seconds=gen / len(engines))
            record.steps.append(row)
            if progress is not None:
                progress(row)
            return now

        asked: asyncio.Future[list[Any]] | None = None  # the engines' statistics, coming
        try:
            busy = await slots.statistics()
            row: StepRecord | None = None
            for step in range(1, config.steps + 1):
                t0 = time.monotonic()
                slots.step = step
                groups = await slots.batch(config.groups_per_step, timeout=600)
                t_wait = time.monotonic() - t0
                lags = [coord.version - min(c.versions) for g in groups for c in g.completions]
                rewards = _score(task, prompts, groups)
                data, meta = rollout_columns(groups)
                adv = group_advantages(torch.tensor(rewards), config.group_size)
                data["advantages"] = adv
                meta["reward"] = rewards
                await client.put(f"train_{step}", data, meta=meta, timeout=60)
                t1 = time.monotonic()
                training = asyncio.gather(*(
                    asyncio.to_thread(call, conn, "train", step) for _, conn in procs.trainers
                ))  # fmt: skip
                try:
                    if row is not None and asked is not None:  # the last step's, while this trains
                        busy = await recorded(row, busy, asked)
                finally:
                    results = await training
                t_train = time.monotonic() - t1
                t2 = time.monotonic()
                if config.sync:
                    await slots.update(pusher(ranks, step, sent), version=step, timeout=120)
                t_sync = time.monotonic() - t2
                asked = asyncio.ensure_future(slots.statistics())
                if gpus is not None:
                    gpus.read()
                wall = time.monotonic() - t_start
                row = StepRecord(
                    step=step, wall=wall, reward_mean=sum(rewards) / len(rewards),
                    reward_max=max(rewards), samples=len(rewards),
                    samples_per_s=len(rewards) / max(1e-9, time.monotonic() - t0),
                    staleness_mean=sum(lags) / len(lags), staleness_max=max(lags),
                    generate_seconds=0.0, wait_seconds=t_wait,
                    train_seconds=t_train, sync_seconds=t_sync,
                    loss=sum(r["loss"] for r in results) / len(results), lags=lags,
                    version=coord.version,
                )  # fmt: skip
            if row is not None and asked is not None:
                await recorded(row, busy, asked)
            at_end = await slots.at(coord.version)  # the engines that serve the last version
            record.summary.update(await final_check(at_end, coord, ranks, config))
            record.summary.update(slots.summary())
            if sent:  # what each rank sends per update: its own shards, or rank 0 all
                record.summary["weights_bytes_per_rank"] = sent[-1]
                if config.lora:
                    record.summary["LoRA: bytes pushed per update"] = sum(sent[-1])
            ends = [e for e in await slots.statistics() if e is not None]
            forwards = sum(e.steps for e in ends)
            if forwards:  # engines that count their forward passes (HFEngine)
                record.summary.update({
                    "engine: forward passes per step": forwards / len(ends) / config.steps,
                    "engine: ms per forward pass": 1e3 * sum(e.step_seconds for e in ends)
                    / forwards,
                })  # fmt: skip
            if gpus is not None:
                share = gpus.percent()
                if share is not None:
                    record.summary["GPU busy, % of the run (NVML)"] = share
                else:
                    record.summary["gpu_busy_why"] = gpus.why
            stats = coord.statistics()
            if stats.updates:  # where an update's time goes, ms per update
                n = stats.updates / 1e3
                rest = stats.update_seconds - stats.pause_seconds - stats.push_seconds
                record.summary.update({
                    "update: pause (ms)": stats.pause_seconds / n,
                    "update: push (ms)": stats.push_seconds / n,
                    "update: commit and resume (ms)": rest / n,
                })  # fmt: skip
        finally:
            await slots.close()
            producer.cancel()
            if asked is not None and not asked.done():
                asked.cancel()  # a step failed: the error told is that one
            await coord.aclose()
            await client.aclose()
            for e in engines:
                await e.aclose()
    record.summary["wall_seconds"] = time.monotonic() - t_start
    return record


def _lr(config: DemoConfig) -> float:
    """GRPO's lr: the run's, else its preset's (with an adapter: ``LORA_LR``'s)."""
    if config.lr is not None:
        return config.lr
    return (LORA_LR if config.lora else RL_LR)[config.model]


def _score(task: Any, prompts: dict[int, Any], groups: list[Group]) -> list[float]:
    out = []
    for g in groups:
        prompt = prompts.pop(g.group)
        out += [task.reward(prompt, c.token_ids) for c in g.completions]
    return out


def run_demo(config: DemoConfig, progress: Any = None) -> RunRecord:
    """Run the demo once (Ctrl-C stops every process it started)."""
    return run_hearing_ctrl_c(lambda: _run(config, progress))


def run_hearing_ctrl_c(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """``asyncio.run(main())``, where a Ctrl-C raises KeyboardInterrupt even if the run
    failed otherwise first. A Ctrl-C at a terminal reaches the whole process group: the
    engine processes stop at once, and the run may fail on one of them (unreachable, on
    a loaded machine) before asyncio cancels it; it is an interrupt all the same. The
    SIGINT handler asyncio installs is chained: a Ctrl-C is noted, then handled as
    asyncio does (the run cancelled, its clean-up run)."""
    heard = threading.Event()
    ours: list[Any] = []

    async def hearing() -> Any:
        theirs = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread() and callable(theirs):

            def note(signum: int, frame: Any) -> None:
                heard.set()
                theirs(signum, frame)

            ours.append(note)
            signal.signal(signal.SIGINT, note)
        return await main()

    try:
        return asyncio.run(hearing())
    except Exception as e:
        if heard.is_set():
            raise KeyboardInterrupt(f"the run also failed: {type(e).__name__}: {e}") from e
        raise
    finally:
        if ours and signal.getsignal(signal.SIGINT) is ours[0]:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def default_out() -> Path:
    return Path("rlferry-demo")


def main(args: Any) -> Path:
    """``rlferry demo``: one run (or, with ``--compare``, synchronous then asynchronous),
    a progress bar per run, the report in ``--out``; returns the report's path."""
    from tqdm import tqdm

    # the demo's bars only: transformers' loading and saving bars (read by huggingface_hub
    # when first imported, here and in the processes the demo starts) would cut into them
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    from .report import format_progress, summarize, write_report

    base = DemoConfig(
        steps=args.steps, engines=args.engines, max_staleness=args.max_staleness,
        device=args.device, engine=args.engine, layout=args.layout, model=args.model,
        seed=args.seed, sync=not args.no_sync, launcher=args.launcher,
        ray_address=args.ray_address, lora=getattr(args, "lora", None),
    )  # fmt: skip
    configs = [base]
    if args.compare:
        asynchronous = (
            base if base.max_staleness > 0 else dataclasses.replace(base, max_staleness=2)
        )
        configs = [dataclasses.replace(base, max_staleness=0), asynchronous]
    runs = []
    for config in configs:
        with tqdm(total=config.steps, desc=config.name, unit="step", dynamic_ncols=True) as bar:

            def progress(row: StepRecord, bar: Any = bar) -> None:
                bar.set_postfix(format_progress(row), refresh=False)
                bar.update(1)

            run = run_demo(config, progress)
        if why := run.summary.get("gpu_busy_why"):
            print(f"rlferry demo: the GPU busy share was not measured: {why}", file=sys.stderr)
        run.summary = {**summarize(run), **{k: v for k, v in run.summary.items()
                                             if isinstance(v, (int, float))
                                             or k == "engine_losses"}}  # fmt: skip
        runs.append(run)
    return write_report(Path(args.out), runs)
