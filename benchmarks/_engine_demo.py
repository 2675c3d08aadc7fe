"""The demo's generation alone: where an HFEngine's forward pass goes at the demo's shapes.

The demo's model (``rlferry.rl.model``, Qwen3-0.6B shapes with the reverse task's
13-token vocabulary) in an HFEngine in this process, with the demo's engine settings
(``max_batch`` a step's samples, ``max_model_len`` 16); each round submits one step's
requests (``--groups`` prompts, 8 samples each, temperature 1, the task's stop token) and
waits for them all, as the demo's engine does between two updates. Per round: the wall
time, the engine's forward passes and their seconds (``statistics()``). Then one round
under ``torch.profiler`` (CPU and CUDA): the kernels' summed time against the round's wall
time (how busy the engine alone keeps the GPU), the top kernels and the top host
operators, and the decode thread's time in its steps' Python parts (timed by wrapping
``sampling``, ``record`` and the batch's ``remove``).

    python benchmarks/_engine_demo.py --groups 64 --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from rlferry.control import GenerateRequest, SamplingParams
from rlferry.engines.hf import HFEngine
from rlferry.engines.hf import _slots as slots_module
from rlferry.rl.model import make_model
from rlferry.rl.task import ReverseTask

SPENT: dict[str, list[float]] = defaultdict(list)


def timed(name: str, fn: Any) -> Any:
    def wrapper(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            SPENT[name].append(time.perf_counter() - t)

    return wrapper


ENDED = [0.0]


def steps(name: str, fn: Any) -> Any:
    """``fn`` timed, and the time since the last step's end (the decode thread's loop)."""
    inner = timed(name, fn)

    def wrapper(*a: Any, **kw: Any) -> Any:
        if ENDED[0]:
            SPENT["between steps (the thread's loop)"].append(time.perf_counter() - ENDED[0])
        try:
            return inner(*a, **kw)
        finally:
            ENDED[0] = time.perf_counter()

    return wrapper


class Replay:
    """A decode graph whose replay (its launch) is timed."""

    def __init__(self, graph: Any) -> None:
        self.replay = timed("graph.replay (the launch)", graph.replay)


async def one_round(engine: HFEngine, task: ReverseTask, groups: int, r: int) -> float:
    rng = random.Random(r)
    params = SamplingParams(
        max_tokens=task.max_tokens, temperature=1.0, stop_token_ids=(task.tokenizer.eos_id,)
    )
    prompts = task.sample(groups, rng)
    t = time.perf_counter()
    await asyncio.gather(*(
        engine.generate(GenerateRequest(
            request_id=f"{r}-{g}-{i}", prompt_ids=p.ids, params=params
        ))
        for g, p in enumerate(prompts) for i in range(8)
    ))  # fmt: skip
    return time.perf_counter() - t


async def main(args: argparse.Namespace) -> None:
    task = ReverseTask()
    model = make_model(args.model, task.tokenizer.vocab_size, seed=0, device=args.device)
    rows = args.groups * 8
    engine = HFEngine(
        model, name="demo", max_batch=max(64, rows), max_model_len=16, kv_cache=args.kv_cache
    )
    batch = engine._batch  # type: ignore[attr-defined]
    for name, what in (
        ("sampling", "rows' settings as tensors"), ("uniforms", "each sampled row's draw"),
        ("sample", "the draw's kernels launched"), ("record", "the sync, then each row's token"),
    ):  # fmt: skip
        setattr(slots_module, name, timed(f"{name} ({what})", getattr(slots_module, name)))
    batch.remove = timed("remove (ended rows out)", batch.remove)
    batch.decode = steps("decode (whole)", batch.decode)
    batch.prefill = steps("prefill (whole)", batch.prefill)
    for key, graph in list(getattr(batch, "_graphs", {}).items()):
        batch._graphs[key] = Replay(graph)
    with engine:
        for r in range(2):
            await one_round(engine, task, args.groups, -1 - r)
        walls, passes, ms = [], [], []
        SPENT.clear()
        for r in range(args.rounds):
            before = await engine.statistics()
            ENDED[0] = 0.0
            walls.append(await one_round(engine, task, args.groups, r))
            after = await engine.statistics()
            n = after.steps - before.steps
            passes.append(n)
            ms.append(1e3 * (after.step_seconds - before.step_seconds) / n)
        print(
            f"# {rows} samples a round, {args.rounds} rounds: wall ms p50 "
            f"{1e3 * statistics.median(walls):.1f} (max {1e3 * max(walls):.1f}); forward "
            f"passes {statistics.median(passes)}; ms a forward pass p50 "
            f"{statistics.median(ms):.2f}"
        )
        for name, spent in sorted(SPENT.items()):
            each, total = len(spent) / args.rounds, 1e3 * sum(spent) / args.rounds
            p50 = 1e3 * statistics.median(spent)
            print(f"  {name}: {each:.1f} a round, {total:.2f} ms a round, p50 {p50:.3f} ms")
        SPENT.clear()
        ENDED[0] = 0.0
        from torch.profiler import ProfilerActivity, profile

        # the decode thread's operators too (by default only this thread's are recorded)
        every = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        cuda = [ProfilerActivity.CUDA] if args.device == "cuda" else []
        with profile(activities=[ProfilerActivity.CPU, *cuda], experimental_config=every) as prof:
            wall = await one_round(engine, task, args.groups, 1000)
            if args.device == "cuda":
                torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
        print(
            f"# profiled round: wall {1e3 * wall:.1f} ms; kernels {kernels / 1e3:.1f} ms "
            f"({100 * kernels / 1e6 / wall:.0f}% of the wall)"
        )
        for name, spent in sorted(SPENT.items()):
            print(f"  {name}: {len(spent)} calls, {1e3 * sum(spent):.2f} ms in all")
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.top))
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
        if args.trace:
            prof.export_chrome_trace(args.trace)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--model", default="qwen3-0.6b", help="a preset of rlferry.rl.model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kv-cache", default=None, help="HFEngine's kv_cache (None: its default)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--trace", default=None, help="write the profiled round's chrome trace here")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse()))
