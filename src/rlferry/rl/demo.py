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
   them into the queue partition ``train_{step}`` (versions in the meta); with
   ``max_staleness >= 1``, the next step's while the ranks train this one (``_batches``);
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
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlferry.control import Coordinator, RemoteEngine, SamplingParams
from rlferry.queue import Queue

from ._batches import Batches
from ._config import WARM, DemoConfig
from ._gpu import GpuBusy
from ._interrupts import run_hearing_ctrl_c
from ._memory import ENGINE_LEN, check_memory
from ._processes import (
    ONE_THREAD,
    Processes,
    RayProcesses,
    free_port,
    start_engine,
    start_trainers,
)
from ._producer import Producer
from ._ranks import closing_figures, pusher, train
from .checkpoints import Checkpoints, TrainedLog, check_resumable, job_state, kill_point, save_job
from .faults import ENGINE_RESTARTS, Engines, generating, process_slots, ray_slots
from .report import RunRecord, StepRecord
from .trainer import measure_peaks

__all__ = ["DemoConfig", "run_demo", "run_hearing_ctrl_c"]

_RUNS = itertools.count()  # a run's number in this process: its Ray job's name


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a future's outcome as heard (another error is told instead of it)."""
    if not future.cancelled():
        future.exception()


async def _run(config: DemoConfig, progress: Any = None) -> RunRecord:
    from .model import make_model, warm_start
    from .task import ReverseTask

    t_begin = time.monotonic()
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
        root = config.checkpoints()
        ckpts = None if root is None else Checkpoints(root, config.checkpoint_keep)
        job: dict[str, Any] | None = None
        at: Path | None = None  # the checkpoint resumed from
        done = 0  # its step
        if config.resume is not None:  # the last whole checkpoint; no warm start
            done, at = Checkpoints(config.resume).latest()
            job = job_state(at)
            check_resumable(config, job["config"], at)
            record.steps = [StepRecord(**r) for r in job["steps"]]
            record.summary["resumed at step"] = done
        elif ckpts is not None:
            ckpts.check_new()
        model_dir = Path(tmp) if ckpts is None else ckpts.base
        # on CUDA the warm start runs on GPU 0 (bfloat16 for qwen3-0.6b), then leaves it
        where = "cuda:0" if config.device == "cuda" else "cpu"
        model = make_model(config.model, tok.vocab_size, seed=config.seed, device=where)
        if job is None:
            warm_steps, warm_lr = WARM[config.model]
            if config.warm_steps is not None:
                warm_steps = config.warm_steps
            warm = warm_start(model, task, steps=warm_steps, seed=config.seed, lr=warm_lr)
            record.summary["warm_start_loss"] = [warm[0], warm[-1]] if warm else []
            model.save_pretrained(model_dir)
        serve_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        record.summary["model: MB (float32 master weights)"] = 4e-6 * model.num_parameters()
        del model
        if config.device == "cuda":
            torch.cuda.empty_cache()
        # the run's processes share the cores: one thread each (see ONE_THREAD)
        threads = torch.get_num_threads()
        torch.set_num_threads(ONE_THREAD)
        stack.callback(torch.set_num_threads, threads)
        # the device's rates for the step's roofline, while nothing else runs on it
        peaks = measure_peaks(torch.device(where), getattr(torch, serve_dtype))
        if on_ray:  # the queue's services as actors of the job, found by name
            stack.callback(procs.stop)
            queue = await asyncio.to_thread(procs.start_queue)
            if config.device == "cuda":
                await asyncio.to_thread(procs.place_gpus, config.gpus()[1], config.engines)
        else:  # the processes stop before the queue closes
            queue = stack.enter_context(
                Queue.restore(at / "queue") if at is not None  # its partitions and acks
                else Queue(storage_units=1, tasks=("train",))
            )  # fmt: skip
            stack.callback(procs.stop)
        engine_gpus, dp = config.gpus()
        settings = {
            "seed": config.seed, "device": config.device, "port": free_port(),
            "model_dir": str(model_dir), "lr": config.grpo_lr(), "lora": config.lora,
            "resume": None if at is None else str(at),
            "clip": config.clip, "sync": config.sync,
            "engines": config.engines, "queue": None if on_ray else queue.address,
            "ray_job": procs.job if on_ray else None,
            "transport": "shm" if config.device == "cpu" else
                         "broadcast" if config.layout == "split" else "cuda_ipc",
            "dtype": serve_dtype, "dp": dp, "sharded": config.sharded(),
            "p2p": config.point_to_point(),
            "first_gpu": engine_gpus if config.layout == "split" else 0,
            "groups_per_step": config.groups_per_step, "group_size": config.group_size,
            "peaks": dataclasses.asdict(peaks),
            # a batch's fixed width: the longest prompt (its letters, ">") and response
            "width": task.length + 1 + task.max_tokens,
            # Ray sets OMP_NUM_THREADS=1 in an actor of a fractional CPU: on CUDA a trainer
            # actor then stepped in 0.32 s where a process of 16 threads took 0.25 (one
            # H100, an eager step): there it gets the threads of the machine
            "threads": ONE_THREAD if config.device == "cpu" or not on_ray else threads,
        }  # fmt: skip
        per_engine = -(-config.groups_per_step * config.group_size // config.engines)
        engines: list[Any]
        # The engines start while the trainers do.
        starting: asyncio.Future[Any]
        if on_ray:  # the engines as actors, driven over HTTP with the job's token
            starting = asyncio.ensure_future(asyncio.to_thread(
                procs.start_engines, str(model_dir), config.engines, config.device, config.engine,
                max(64, per_engine), ENGINE_LEN, config.lora, ENGINE_RESTARTS,
            ))  # fmt: skip
        else:

            def start_one(i: int) -> str:
                return start_engine(procs, str(model_dir), i, config.engine_device(i),
                                    config.engine, max(64, per_engine), ENGINE_LEN,
                                    config.lora)  # fmt: skip

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
        ranks = [conn for _, conn in procs.trainers]
        sent: list[list[int]] = []  # per update, the bytes each trainer rank pushed
        pushed: list[float] = []  # per update, the slowest rank's push (its own seconds)
        coord = Coordinator(engines, batch_size=batch, max_staleness=config.max_staleness,
                            version=max(0, done - 1) if config.sync else 0)  # fmt: skip
        start, ended = ray_slots(procs.engine_actors) if on_ray else process_slots(procs, start_one)
        slots = Engines(engines, start=start, ended=ended, weights=sender)
        slots.attach(coord)
        engines = slots.handles
        if config.sync:  # how a replacement is caught up when no engine serves
            slots.push_at = lambda version: pusher(ranks, version, sent)
        if job is not None:  # resumed: the engines (the base model, version 0) get the
            if config.sync:  # checkpoint's weights, as its version, before its counters
                await slots.update(pusher(ranks, done, sent), version=done, timeout=120)
            coord.load_state_dict(job["coordinator"])
        produced = Producer(task, config.seed, None if job is None else job["producer"])
        params = SamplingParams(
            max_tokens=task.max_tokens, temperature=1.0, stop_token_ids=(tok.eos_id,)
        )
        trained = None if config.out is None else TrainedLog(
            Path(config.out) / "trained.jsonl", after=None if job is None else done
        )  # fmt: skip
        if trained is not None:
            stack.callback(trained.close)

        # Everything made so far (torch, transformers, the model, the services) lives as long
        # as the run: out of the garbage collector's sight, a full collection scans only
        # what the steps make (without this: 130-290 ms pauses every ~8 steps here).
        gc.freeze()
        stack.callback(gc.unfreeze)
        producer = asyncio.ensure_future(produced.run(coord, params, config.group_size))
        client = queue.async_client()
        batches = Batches(slots, coord, produced, client, groups=config.groups_per_step,
                          group_size=config.group_size, sync=config.sync)  # fmt: skip
        t_start = time.monotonic()
        wall0 = record.steps[-1].wall if record.steps else 0.0  # a resumed run's wall so far
        written: list[tuple[float, int]] = []  # each checkpoint's seconds and bytes
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
        # an asynchronous run's update, in flight while the next step's ranks get their batch
        pending: asyncio.Future[Any] | None = None
        pushing = asyncio.Event()  # set once its push was sent to the ranks
        try:
            busy = await slots.statistics()
            row: StepRecord | None = None
            for step in range(done + 1, config.steps + 1):
                t0 = time.monotonic()
                slots.step = step
                if pending is not None and not batches.ready(step):  # rollouts to wait for:
                    await pending  # the update ends meanwhile (a catch-up waits for it)
                    pending = None
                taken = await batches.take(step)
                rewards, uids, lags = taken.rewards, taken.uids, taken.lags
                t1 = time.monotonic()
                # this step's own wait: a batch taken ahead, while the step before
                # trained, was scored and put off this step's time
                t_wait = max(0.0, min(taken.at, t1) - t0)
                t_put = t1 - max(t0, taken.at)
                training = asyncio.ensure_future(train(ranks, step, pending, pushing))
                pending = None
                # asynchronous, the next step's batch is taken while this one trains, and
                # its ranks get it while this step's update pushes; a checkpoint's step (no
                # batch held, the weights saved) and the last are taken and updated whole
                ahead = bool(config.max_staleness) and step < config.steps and not (
                    ckpts is not None and config.checkpoint_every
                    and step % config.checkpoint_every == 0
                )  # fmt: skip
                if ahead:
                    batches.ahead(step + 1)
                kill_point("train", step)
                if step == done + 1 and job is not None:
                    kill_point("resumed", step)
                try:
                    if row is not None and asked is not None:  # the last step's, while this trains
                        busy = await recorded(row, busy, asked)
                finally:
                    results = await training
                await client.clear(f"train_{step}")  # trained and acked by every rank
                if trained is not None:
                    trained.append(step, step, uids)
                if step == done + 1 and job is not None:
                    record.summary["resume: seconds to the first trained step"] = (
                        time.monotonic() - t_begin)  # fmt: skip
                # what the ranks' step waited for the update before it is weight sync
                held = max(r["held_seconds"] for r in results)
                t_train = time.monotonic() - t1 - held
                t2 = time.monotonic()
                pushing = asyncio.Event()
                push = pusher(ranks, step, sent, pushed, pushing)
                update = None
                if config.sync and ahead:
                    pending = asyncio.ensure_future(slots.update(push, version=step, timeout=120))
                elif config.sync:
                    update = await slots.update(push, version=step, timeout=120)
                # the update's own seconds; then the requests it let go start here, before
                # the next train command (a partial update: all of it counts as sync)
                t_sync = 0.0 if pending is not None else time.monotonic() - t2
                t_update = t_sync if update is None else min(t_sync, update.seconds)
                asked = asyncio.ensure_future(slots.statistics())
                if gpus is not None:
                    gpus.read(every=1.0)
                row = StepRecord(
                    step=step, wall=wall0 + time.monotonic() - t_start,
                    reward_mean=sum(rewards) / len(rewards),
                    reward_max=max(rewards), samples=len(rewards),
                    samples_per_s=len(rewards) / max(1e-9, time.monotonic() - t0),
                    staleness_mean=sum(lags) / len(lags), staleness_max=max(lags),
                    generate_seconds=0.0, wait_seconds=t_wait,
                    train_seconds=t_train, sync_seconds=t_update + held,
                    dispatch_seconds=t_sync - t_update, put_seconds=t_put,
                    get_seconds=max(r["get_seconds"] for r in results),
                    optimize_seconds=max(r["step_seconds"] for r in results),
                    loss=sum(r["loss"] for r in results) / len(results), lags=lags,
                    version=step if pending is not None else coord.version,
                )  # fmt: skip
                if ckpts is not None and config.checkpoint_every and (
                        step % config.checkpoint_every == 0):  # fmt: skip
                    busy = await recorded(row, busy, asked)  # the record so far, whole
                    row = asked = None
                    written.append(await save_job(
                        ckpts, step, ranks, None if on_ray else queue, {
                            "step": step, "config": dataclasses.asdict(config),
                            "coordinator": coord.state_dict(), "producer": produced.state(),
                            "steps": [dataclasses.asdict(r) for r in record.steps],
                        },
                    ))  # fmt: skip
                kill_point("step", step)
            if row is not None and asked is not None:
                await recorded(row, busy, asked)
            if gpus is not None:
                gpus.read()  # the samples to the last step's end
            at_end = await slots.at(coord.version)  # the engines that serve the last version
            record.summary.update(slots.summary())
            record.summary.update(await closing_figures(
                at_end, [e for e in await slots.statistics() if e is not None], coord, ranks,
                config, steps=config.steps - done, sent=sent, written=written, gpus=gpus,
                pushed=pushed,
            ))  # fmt: skip
        finally:
            batches.cancel()
            if pending is not None and not pending.done():  # a step failed: its error is told
                pending.cancel()
                pending.add_done_callback(lambda t: t.cancelled() or t.exception())
            await slots.close()
            producer.cancel()
            if asked is not None and not asked.done():
                asked.cancel()  # a step failed: the error told is that one
            await coord.aclose()
            await client.aclose()
            for e in engines:
                await e.aclose()
    record.summary["wall_seconds"] = wall0 + time.monotonic() - t_start
    return record


def run_demo(config: DemoConfig, progress: Any = None) -> RunRecord:
    """Run the demo once (Ctrl-C stops every process it started)."""
    return run_hearing_ctrl_c(lambda: _run(config, progress))
