"""cuda_ipc pushes of a model's state dict into an engine process, back to back and apart.

A trainer pushes once a step, so a push finds the threads it wakes idle: the same
``WeightSender`` pushes of ``--model``'s state dict into ``weights.py``'s engine process
(zero copy, grouped load), ten back to back and six ``--gap`` ms apart, beside a flat
device copy of the same bytes in the same call. Prints the p50 of each, their ratio to the
flat copy, every push's ms, and how many the pushing thread started itself.

    python benchmarks/_push_gaps.py --model qwen3-8b,qwen3-0.6b-demo
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlferry.weights import WeightSender
from weights import Engine, flat_copy_seconds

import _weights_engine as eng


def run(model: str, gap_s: float) -> str:
    shapes = eng.model_shapes(model, 1)
    dev = "cuda:0"
    torch.cuda.set_device(dev)
    nbytes = sum(s.nbytes for s in eng.specs_of(shapes))
    flat = flat_copy_seconds(nbytes, dev, 6).p50 * 1e3
    state = eng.make_state(shapes, dev)
    engine = Engine(eng.engine_main, shapes, dev)
    sender = WeightSender(group="bench", transport="cuda_ipc", receivers=1)
    try:
        engine.send("rlferry", sender.address, "bench", "engine0", "grouped")
        assert engine.wait() == "joined"
        version = iter(range(1, 1 << 30))
        for _ in range(4):  # the plan, the handles, the grouped copies
            sender.push(state.items(), version=next(version))
        out = {}
        for gap, n in ((0.0, 10), (gap_s, 6)):
            times = []
            for _ in range(n):
                time.sleep(gap)
                t = time.perf_counter()
                sender.push(state.items(), version=next(version))
                times.append((time.perf_counter() - t) * 1e3)
            out[gap] = sorted(times)
        stats = sender.statistics()
        engine.conn.send("done")
        engine.wait()
    finally:
        sender.close()
        engine.stop()
    lines = [f"{model}: {nbytes / 1e9:.2f} GB; flat device copy {flat:.2f} ms; pushes started "
             f"by the pushing thread {stats.started_here} of {stats.pushes}"]  # fmt: skip
    for gap, times in out.items():
        p50 = statistics.median(times)
        lines.append(f"  {1e3 * gap:.0f} ms apart: p50 {p50:.2f} ms ({p50 / flat:.2f}x the flat "
                     f"copy); {', '.join(f'{x:.2f}' for x in times)}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b", help="comma-separated (weights.py's models)")
    p.add_argument("--gap", type=float, default=200.0, help="ms between the spaced pushes")
    a = p.parse_args()
    for model in a.model.split(","):
        print(run(model, a.gap / 1e3), flush=True)


if __name__ == "__main__":
    main()
