"""Faults and recovery: how long a fleet takes to serve again after a fault, and how
much it generates after, against the same window with no fault, in one run.

Two engine processes (``rlferry serve engine``, a tiny random-init Llama) under a steady
load from one ``Coordinator`` (groups of 8 samples, 16 new tokens each, up to 64 samples
in flight). Faults, each injected ``--repeats`` times:

- **failed push**: ``update_weights`` whose push raises before any byte moves (the
  trainer's gather failed);
- **bad request**: a prompt with a token id outside the vocabulary sent to an engine
  (its server answers 400: the request fails, the engine serves on), then the same
  prompt through ``Coordinator.submit`` (refused before it is queued);
- **engine restart**: an engine process killed mid-generation (its samples go on on
  the other), started again, re-added with ``add_engine`` and brought to the fleet's
  version by an update before it serves.

Recovery: from the fault's start until the call that failed returned and every
healthy engine gets rollouts again (for a restart: from ``add_engine`` until the
restarted engine gets rollouts, an update included). Throughput: tokens of the samples
finished in the ``--window`` seconds after the fault, against a window with no fault
measured just before it (ratio after / before).

    python benchmarks/faults.py                   # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import subprocess
import sys
import tempfile
import time

from rlferry.control import (
    Coordinator,
    GenerateRequest,
    RemoteEngine,
    RequestError,
    SamplingParams,
    WeightUpdateError,
)
from rlferry.weights import WeightSender

from _common import table, tiny

PARAMS = SamplingParams(max_tokens=16, temperature=1.0)


class Load:
    """Keeps the coordinator busy and records every finished sample: (time, engine, tokens)."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.done: list[tuple[float, str, int]] = []
        self._tasks = [asyncio.ensure_future(self._produce()), asyncio.ensure_future(self._take())]

    async def _produce(self) -> None:
        k = 0
        while True:
            future = await self.coord.submit([1, 2, 3, 4], PARAMS, n=8, group=k, timeout=600)
            future.add_done_callback(self._finished)
            k += 1

    async def _take(self) -> None:
        while True:
            await self.coord.batch(1, timeout=600)

    def _finished(self, future: asyncio.Future) -> None:  # type: ignore[type-arg]
        if future.cancelled() or future.exception() is not None:
            return
        now = time.perf_counter()
        for c in future.result().completions:
            self.done.append((now, c.engine, len(c.token_ids)))

    async def rate(self, window: float) -> float:
        """Tokens per second of the samples that finish in the next ``window`` seconds."""
        t0 = time.perf_counter()
        await asyncio.sleep(window)  # a measurement window, not a wait for a condition
        return sum(n for t, _, n in self.done if t0 < t <= t0 + window) / window

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def start_engine(model_dir: str, name: str) -> tuple[subprocess.Popen[str], RemoteEngine]:
    cmd = [sys.executable, "-m", "rlferry.cli", "serve", "engine", "--model", model_dir,
           "--name", name]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, RemoteEngine(proc.stdout.readline().split()[1], name=name)


def failing_source():
    raise RuntimeError("the trainer's gather failed")
    yield


async def main(args: argparse.Namespace) -> None:
    model = tiny()
    state = model.state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        procs: dict[str, subprocess.Popen[str]] = {}
        engines = {}
        for name in ("e0", "e1"):
            procs[name], engines[name] = start_engine(tmp, name)
        sender = WeightSender(group="faults", transport="shm", receivers=2)
        for e in engines.values():
            await e.init_weight_transfer("faults", sender.address)
        coord = Coordinator(list(engines.values()), batch_size=8, max_staleness=10**6,
                            max_running=64)  # fmt: skip
        load = Load(coord)
        version = 0

        def serving(n: int) -> float:
            """Now, once ``n`` engines get rollouts (the call that recovers returned)."""
            stats = coord.statistics()
            assert stats.engines_serving == n, stats.not_serving
            return time.perf_counter()

        def push(v: int):  # a successful push of the same weights
            return lambda t: sender.push(state.items(), version=v, timeout=t)

        async def failed_push() -> float:
            t0 = time.perf_counter()
            try:
                await coord.update_weights(
                    lambda t: sender.push(failing_source(), version=version + 1, timeout=t),
                    version=version + 1,
                )  # fmt: skip
            except WeightUpdateError as e:  # the fault being measured
                assert list(e.failures) == ["push"], e
            else:
                raise AssertionError("the failing push went through")
            return serving(2) - t0

        async def bad_request() -> float:
            t0 = time.perf_counter()
            bad = GenerateRequest(request_id="bad", prompt_ids=[1, 999], params=PARAMS)
            for refused in (engines["e0"].generate(bad), coord.submit([1, 999], PARAMS)):
                try:
                    await refused
                except RequestError:  # the fault being measured
                    continue
                raise AssertionError("the bad request was not refused")
            return serving(2) - t0

        async def restart() -> float:
            nonlocal version
            procs["e1"].kill()
            procs["e1"].wait(30)
            await load.rate(1.0)  # a request to it fails meanwhile: it is broken
            assert coord.statistics().engines_serving == 1, coord.statistics()
            await engines["e1"].aclose()
            procs["e1"], engines["e1"] = start_engine(tmp, "e1")
            await engines["e1"].init_weight_transfer("faults", sender.address)
            t0 = time.perf_counter()
            coord.add_engine(engines["e1"])
            version += 1
            await coord.update_weights(push(version), version=version)
            return serving(2) - t0

        rows = []
        try:
            await load.rate(2.0)  # warm up
            for label, fault in (("failed push", failed_push), ("bad request", bad_request),
                                 ("engine restart", restart)):  # fmt: skip
                recovery, ratios, before_all, after_all = [], [], [], []
                for _ in range(args.repeats):
                    before = await load.rate(args.window)
                    recovery.append(await fault())
                    after = await load.rate(args.window)
                    before_all.append(before)
                    after_all.append(after)
                    ratios.append(after / before if before else float("nan"))
                    print(f"{label}: recovery {recovery[-1] * 1e3:.1f} ms, {before:.0f} -> "
                          f"{after:.0f} tokens/s", flush=True)  # fmt: skip
                r = sorted(recovery)
                pick = [r[len(r) // 2], r[min(len(r) - 1, round(0.9 * (len(r) - 1)))], r[-1]]
                mid = sorted(ratios)[len(ratios) // 2]
                rows.append([label, *(f"{x * 1e3:.1f}" for x in pick),
                             f"{sum(before_all) / len(before_all):.0f}",
                             f"{sum(after_all) / len(after_all):.0f}",
                             f"{min(ratios):.2f} / {mid:.2f}"])  # fmt: skip
        finally:
            await load.close()
            await coord.aclose()
            for e in engines.values():
                await e.aclose()
            for p in procs.values():
                p.terminate()
                p.wait(30)
            sender.close()
    print(f"\n{platform.node()}, {args.repeats} faults of each kind, {args.window:g} s windows")
    header = ["fault", "recovery p50 ms", "p90", "max", "tokens/s before", "after",
              "after / before (min / p50)"]  # fmt: skip
    print(table(rows, header))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=float, default=10.0, help="seconds of each throughput window")
    p.add_argument("--repeats", type=int, default=3, help="faults of each kind")
    asyncio.run(main(p.parse_args()))
