"""The demo's training step: eager against the CUDA graph, beside its roofline estimate.

The demo's trainer step (``rlferry.rl.trainer._step.TrainStep``: the GRPO loss, its
backward, gradient clipping, fused AdamW) on the ``--model`` preset with the demo's
batches: ``--groups`` GRPO groups of 8 sequences of the reverse task (a prompt of 6
tokens, a response of 1-6), padded to 12 tokens. Both runs start from the same weights
and train on the same batches: the eager run (the baseline: what a rank of several runs)
and the graphed one (one GPU's); their weights must agree after the last step. Prints
p50 / p90 / max of each step after the first, their ratio, and the step's
roofline estimate (FLOPs and bytes at the rates measured on the device). ``--profile N``:
the N kernels of the graphed step that take the most device time (``torch.profiler`` over
a few replays).

    python benchmarks/train_step.py --device cuda --groups 16,64 --profile 25
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch

from rlferry.rl.grpo import GrpoBatch, PaddedBatch
from rlferry.rl.model import make_model
from rlferry.rl.task import ReverseTask
from rlferry.rl.trainer._roofline import measure_peaks, step_roofline
from rlferry.rl.trainer._step import TrainStep

from _common import table


def _batches(task: ReverseTask, rows: int, n: int, seed: int) -> list[GrpoBatch]:
    """``n`` batches as a demo's rank gets them from the queue (a tensor a row): prompts,
    responses of 1 to max_tokens ids, engine logprobs near the model's, advantages of
    either sign."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompts = [p.ids for p in task.sample(rows, rng)]
        vocab = task.tokenizer.vocab_size
        responses = [
            [rng.randrange(3, vocab) for _ in range(rng.randint(1, task.max_tokens))]
            for _ in range(rows)
        ]
        logprobs = [[-2.5 + 0.1 * rng.random() for _ in r] for r in responses]
        adv = [rng.gauss(0.0, 1.0) for _ in range(rows)]
        rows_of = lambda xs, dt: [torch.tensor(x, dtype=dt) for x in xs]  # noqa: E731
        out.append(GrpoBatch(rows_of(prompts, torch.long), rows_of(responses, torch.long),
                             rows_of(logprobs, torch.float32), torch.tensor(adv)))  # fmt: skip
    return out


def _run(
    model: torch.nn.Module, batches: list[GrpoBatch], rows: int, width: int, graphed: bool,
    dtype: torch.dtype | None,
) -> tuple[list[float], float, TrainStep]:  # fmt: skip
    params = list(model.parameters())
    cuda = params[0].device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=3e-5, weight_decay=0.0, fused=cuda, capturable=graphed)
    t0 = time.perf_counter()
    step = TrainStep(model, params, opt, rows=rows, width=width, clip=0.2, autocast=dtype,
                     graphed=graphed)  # fmt: skip
    made = time.perf_counter() - t0  # a graph's compile, warm-up and capture
    times = []
    for b in batches:
        t0 = time.perf_counter()
        step(b)  # ends on the step's figures read: the device is done
        times.append(time.perf_counter() - t0)
    return times[1:], made, step


def _profile(step: TrainStep, batches: list[GrpoBatch], top: int) -> None:
    """Print the ``top`` kernels by device time over the replays of ``batches``."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in batches:
            t0 = time.perf_counter()
            step(b)
            walls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for b in batches:
        PaddedBatch.of(b, step.width)
    host = (time.perf_counter() - t0) / len(batches)
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / len(batches)
    kernels = sum(e.count for e in events) // len(batches)
    print(
        f"the graphed step: {kernels} kernels, {total / 1e3:.1f} ms of device time; the steps "
        f"took {', '.join(f'{1e3 * w:.1f}' for w in walls)} ms, of which padding the batch on "
        f"the host {1e3 * host:.1f} ms"
    )
    print(events.table(sort_by="device_time_total", row_limit=top, max_name_column_width=90))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--groups", default="16", help="GRPO groups of 8 a step, comma-separated")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", type=int, default=0, help="print the graphed step's N top kernels")
    a = p.parse_args()
    device = torch.device(a.device)
    task = ReverseTask()
    width = task.length + 1 + task.max_tokens
    base = make_model(a.model, task.tokenizer.vocab_size, seed=0, device=device,
                      dtype=torch.float32).train()  # fmt: skip
    low = torch.bfloat16 if device.type == "cuda" and a.model == "qwen3-0.6b" else None
    peaks = measure_peaks(device, low or torch.float32)
    print(f"{a.model} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}"
          f": measured {peaks.flops / 1e12:.0f} TFLOP/s ({peaks.dtype}), "
          f"{peaks.bandwidth / 1e9:.0f} GB/s")  # fmt: skip
    rows_out = []
    for groups in (int(g) for g in a.groups.split(",")):
        rows = groups * 8
        batches = _batches(task, rows, a.steps, seed=groups)
        roof = step_roofline(base, rows, width, low=low is not None, peaks=peaks)
        runs: dict[bool, list[float]] = {}
        made: dict[bool, float] = {}
        models, steps = {}, {}
        for graphed in (False, True) if device.type == "cuda" else (False,):
            models[graphed] = copy.deepcopy(base)
            runs[graphed], made[graphed], steps[graphed] = _run(
                models[graphed], batches, rows, width, graphed, low
            )
        if True in models:  # the same weights after the same steps
            worst = max(
                float((x - y).detach().abs().max())
                for x, y in zip(models[False].parameters(), models[True].parameters(), strict=True)
            )
            if worst > 1e-3:
                raise SystemExit(f"graphed and eager weights differ by {worst} ({a.steps} steps)")
            if a.profile:  # after the check: the profiled replays step the weights further
                _profile(steps[True], batches[-3:], a.profile)
        eager = statistics.median(runs[False])
        for graphed, times in runs.items():
            t = sorted(times)
            p50, p90 = statistics.median(t), t[int(0.9 * (len(t) - 1))]
            rows_out.append([
                f"{groups} groups ({rows} x {width} tokens)",
                "compiled CUDA graph" if graphed else "eager", f"{made[graphed]:.1f}",
                f"{1e3 * p50:.1f} / {1e3 * p90:.1f} / {1e3 * t[-1]:.1f}",
                f"{eager / p50:.2f}x", f"{1e3 * roof.seconds:.1f} ({roof.flops / 1e12:.1f} TFLOP, "
                f"{roof.bytes / 1e9:.1f} GB)", f"{p50 / roof.seconds:.2f}",
            ])  # fmt: skip
        for m in models.values():
            del m
        models.clear()
        steps.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    head = ["batch", "step", "made in s", "ms p50 / p90 / max", "vs eager", "roofline ms",
            "step / roofline"]  # fmt: skip
    print(table(rows_out, head))


if __name__ == "__main__":
    main()
