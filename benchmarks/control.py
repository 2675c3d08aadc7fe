"""Control-plane benchmark: completion delivery, idle cost, and the weight-update cycle.

- **Delivery**: how long after an engine has a completion its caller holds it. Pushed
  (rlferry): in-process, the engine's future; across processes, the HTTP response of
  ``rlferry serve engine`` (the server stamps ``X-Rlferry-Done-Ns`` when the answer is
  ready, on the host's monotonic clock). Polled (the baseline, AReaL's ``_fetch_loop``
  with ``wait(timeout=0.05)``): the caller looks for finished requests every 50 ms.
  Each request generates one token on a tiny model; p50, p99 and max over
  ``--requests``.
- **Fan-out**: a GRPO step's requests started at once (``--burst``, one token each) on
  an engine process: the caller's CPU time and the wall time until every completion is
  held, through :class:`RemoteEngine` (the requests of one turn of the event loop travel
  as one ``/generate_many`` exchange, each completion pushed as it ends) against one
  HTTP exchange a request (``POST /generate``, the baseline). p50, p90 and max over
  ``--repeat`` bursts.
- **Rollouts**: a training step's samples through a ``Coordinator`` (``--groups`` GRPO
  groups of 8 one-token samples, each group submitted, then one ``batch``) against the same
  requests straight through ``RemoteEngine``: the caller's CPU a sample, the difference
  being the coordinator's own work (admission, routing, each sample's task, its group).
- **Idle**: a coordinator (this process) and two engine processes with nothing to do for
  ``--idle`` seconds: CPU time of the three, as a share of one core.
- **Update cycle**: ``Coordinator.update_weights`` (in ``keep`` mode an ``HFEngine``, which
  loads between its own steps, is neither paused nor resumed: the push alone) against
  the bare ``WeightSender.push`` of the same weights, shm on the CPU (``--device cpu``)
  or cuda_ipc on one GPU (``--device cuda``), with the engine idle and while it
  generates (the push then waits for the decode step in flight). ``--model tiny`` or
  ``qwen3-0.6b`` (the Qwen3-0.6B shapes, random init, bf16 on CUDA).

    python benchmarks/control.py                         # CPU, about a minute
    python benchmarks/control.py --device cuda --model qwen3-0.6b --only update
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import torch

from rlferry.control import (
    Completion,
    Coordinator,
    GenerateRequest,
    RemoteEngine,
    SamplingParams,
)
from rlferry.engines.hf import HFEngine
from rlferry.weights import WeightSender

from _common import table, tiny

_POLL = 0.05  # the baseline's poll interval (AReaL: wait(timeout=0.05))


def qwen3_06b(device: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=4096,
    )  # fmt: skip
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return transformers.Qwen3ForCausalLM(config).to(device, dtype).eval()


def stats_ms(seconds: list[float], at: tuple[float, ...] = (0.5, 0.99)) -> list[str]:
    """The quantiles ``at`` and the max, in ms."""
    s = sorted(seconds)
    pick = [s[min(len(s) - 1, round(q * (len(s) - 1)))] for q in at] + [s[-1]]
    return [f"{x * 1e3:.3f}" for x in pick]


def one_token(i: int) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"d{i}", prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=1)
    )


# -- delivery -------------------------------------------------------------------------------
async def delivered_in_process(engine: HFEngine, n: int) -> list[float]:
    """From the engine's thread handing a completion over (it calls ``settle``, timed
    here) to the awaiting task holding it."""
    from rlferry.engines.hf import _thread

    handed: dict[int, float] = {}
    settle = _thread.settle

    def timed(loop: Any, future: Any, result: Any = None, error: Any = None) -> None:
        handed[id(future)] = time.perf_counter()
        settle(loop, future, result, error)

    _thread.settle = timed
    out = []
    try:
        for i in range(n):
            fut = asyncio.ensure_future(engine.generate(one_token(i)))
            await fut
            got = time.perf_counter()
            out.append(got - max(handed.values()))
            handed.clear()
    finally:
        _thread.settle = settle
    return out


async def polled_in_process(engine: HFEngine, n: int) -> list[float]:
    """The baseline: the engine's result lands in a dict; the caller looks every 50 ms."""
    out = []
    finished: dict[str, float] = {}

    async def run(req: GenerateRequest) -> None:
        await engine.generate(req)
        finished[req.request_id] = time.perf_counter()

    for i in range(n):
        req = one_token(i)
        task = asyncio.ensure_future(run(req))
        while req.request_id not in finished:
            await asyncio.sleep(_POLL)  # the poll loop being measured
        out.append(time.perf_counter() - finished.pop(req.request_id))
        await task
    return out


async def delivered_across(url: str, n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            body = msgspec.json.encode(one_token(i))
            async with session.post(url + "/generate", data=body) as resp:
                raw = await resp.read()
                got = time.monotonic_ns()
                msgspec.json.decode(raw, type=Completion)
                out.append((got - int(resp.headers["X-Rlferry-Done-Ns"])) / 1e9)
    return out


async def delivered_framed(url: str, n: int) -> list[float]:
    """As :func:`delivered_across`, through ``/generate_many`` (what ``RemoteEngine``
    sends): the frame's ``done_ns`` against its arrival."""
    from rlferry.control._http import FRAME_DECODER, LENGTH

    out = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            body = msgspec.json.encode([one_token(i)])
            async with session.post(url + "/generate_many", data=body) as resp:
                (size,) = LENGTH.unpack(await resp.content.readexactly(LENGTH.size))
                frame = FRAME_DECODER.decode(await resp.content.readexactly(size))
                got = time.monotonic_ns()
                assert frame.completion is not None, frame
                out.append((got - frame.done_ns) / 1e9)
    return out


def serve(model_dir: str, name: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "rlferry.cli", "serve", "engine", "--model", model_dir,
           "--name", name, *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("engine "):
        raise RuntimeError(f"rlferry serve engine did not start: {line!r}")
    return proc, line.split()[1]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_delivery(args: argparse.Namespace) -> str:
    engine = HFEngine(tiny(), name="bench")
    await engine.generate(one_token(-1))  # warm-up
    rows = []
    pushed = await delivered_in_process(engine, args.requests)
    polled = await polled_in_process(engine, max(10, args.requests // 10))
    engine.close()
    with tempfile.TemporaryDirectory() as d:
        tiny().save_pretrained(d)
        proc, url = serve(d, "far")
        try:
            async with aiohttp.ClientSession() as s:
                await (
                    await s.post(url + "/generate", data=msgspec.json.encode(one_token(-1)))
                ).read()
            across = await delivered_across(url, args.requests)
            framed = await delivered_framed(url, args.requests)
            far_polled = await polled_far(url, max(10, args.requests // 10))
        finally:
            proc.terminate()
            proc.wait(30)
    rows.append(["pushed, in process (the engine's future)", *stats_ms(pushed)])
    rows.append(["pushed, across processes (HTTP response)", *stats_ms(across)])
    rows.append(["pushed, across processes (a /generate_many frame, RemoteEngine's way)",
                 *stats_ms(framed)])  # fmt: skip
    rows.append([f"polled every {_POLL * 1e3:.0f} ms, in process (baseline)", *stats_ms(polled)])
    rows.append([f"polled every {_POLL * 1e3:.0f} ms, across processes (baseline)",
                 *stats_ms(far_polled)])  # fmt: skip
    return "Completion delivery (engine has it -> caller holds it), ms\n\n" + table(
        rows, ("path", "p50", "p99", "max")
    )


async def polled_far(url: str, n: int) -> list[float]:
    """Polling across processes: the engine's stamp of each answer is when it was ready."""
    out = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            body = msgspec.json.encode(one_token(i))
            ready: list[int] = []

            async def call(body: bytes = body, ready: list[int] = ready) -> None:
                async with session.post(url + "/generate", data=body) as resp:
                    await resp.read()
                    ready.append(int(resp.headers["X-Rlferry-Done-Ns"]))

            task = asyncio.ensure_future(call())
            while not ready:  # the baseline's poll loop: look every 50 ms
                await asyncio.sleep(_POLL)
            out.append((time.monotonic_ns() - ready[0]) / 1e9)
            await task
    return out


async def alternated(
    calls: dict[str, Callable[[int], Awaitable[tuple[float, float]]]], repeat: int
) -> dict[str, list[tuple[float, float]]]:
    """Each of ``calls`` in turn (round ``k`` passed), ``repeat`` rounds after two of warm-up:
    what each returned in the timed rounds, by name."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for k in range(repeat + 2):
        for name, call in calls.items():
            got = await call(k)
            if k >= 2:
                runs[name].append(got)
    return runs


# -- fan-out ------------------------------------------------------------------------------
async def run_fanout(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as d:
        tiny().save_pretrained(d)
        proc, url = serve(d, "fan")
        remote = RemoteEngine(url, name="fan")
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def each(req: GenerateRequest) -> Completion:  # the baseline: one exchange each
            async with session.post(url + "/generate", data=msgspec.json.encode(req)) as resp:
                return msgspec.json.decode(await resp.read(), type=Completion)

        async def burst(call: Any, k: int) -> tuple[float, float]:
            reqs = [one_token(k * args.burst + i) for i in range(args.burst)]
            cpu, wall = time.process_time(), time.perf_counter()
            done = await asyncio.gather(*(call(r) for r in reqs))
            assert [c.request_id for c in done] == [r.request_id for r in reqs]
            return time.process_time() - cpu, time.perf_counter() - wall

        try:
            runs = await alternated({
                "batched": lambda k: burst(remote.generate, 2 * k),
                "each": lambda k: burst(each, 2 * k + 1),
            }, args.repeat)  # fmt: skip
        finally:
            await remote.aclose()
            await session.close()
            proc.terminate()
            proc.wait(30)
    rows = []
    for name, label in (("batched", "RemoteEngine, one /generate_many exchange"),
                        ("each", "one POST /generate a request (baseline)")):  # fmt: skip
        cpu = [c for c, _ in runs[name]]
        wall = [w for _, w in runs[name]]
        rows.append([label, *stats_ms(cpu, (0.5, 0.9)), *stats_ms(wall, (0.5, 0.9))])
    ratio = statistics.median(c for c, _ in runs["each"]) / statistics.median(
        c for c, _ in runs["batched"]
    )
    head = ("path", "CPU p50", "CPU p90", "CPU max", "wall p50", "wall p90", "wall max")
    return (
        f"Fan-out: {args.burst} one-token requests at once, the caller's CPU and wall ms "
        f"({args.repeat} bursts; caller CPU p50, baseline / RemoteEngine: {ratio:.1f}x)\n\n"
        + table(rows, head)
    )


# -- rollouts ---------------------------------------------------------------------------------
async def run_rollouts(args: argparse.Namespace) -> str:
    """A training step's samples through a ``Coordinator`` (``--groups`` groups of 8
    one-token samples: submit each group, then ``batch``) against the same requests sent
    straight through ``RemoteEngine`` (the baseline): the caller's CPU a sample, which is
    the coordinator's own work (admission, routing, the sample's task, its group)."""
    n = 8
    with tempfile.TemporaryDirectory() as d:
        tiny().save_pretrained(d)
        proc, url = serve(d, "roll")
        remote = RemoteEngine(url, name="roll")
        params = SamplingParams(max_tokens=1)
        samples = args.groups * n
        # as the demo's driver does once started: torch's and transformers' objects are
        # not scanned again (a full collection of them takes ~0.2 s here, in some round)
        gc.collect()
        gc.freeze()

        async def coordinated(k: int) -> tuple[float, float]:
            coord = Coordinator([remote], batch_size=samples, max_staleness=0)
            cpu, wall = time.thread_time(), time.perf_counter()
            for g in range(args.groups):
                await coord.submit([1, 2, 3 + g % 8], params, n=n, group=(k, g))
            groups = await coord.batch(args.groups, timeout=60)
            took = time.thread_time() - cpu, time.perf_counter() - wall
            assert sum(len(x.completions) for x in groups) == samples
            await coord.aclose()
            return took

        async def bare(k: int) -> tuple[float, float]:
            reqs = [
                GenerateRequest(request_id=f"b{k}-{i}", prompt_ids=[1, 2, 3 + i // n % 8],
                                params=params)
                for i in range(samples)
            ]  # fmt: skip
            cpu, wall = time.thread_time(), time.perf_counter()
            done = await asyncio.gather(*(remote.generate(r) for r in reqs))
            took = time.thread_time() - cpu, time.perf_counter() - wall
            assert len(done) == samples
            return took

        try:
            runs = await alternated({"coordinator": coordinated, "bare": bare}, args.repeat)
        finally:
            await remote.aclose()
            proc.terminate()
            proc.wait(30)
    rows = []
    for name, label in (("coordinator", "Coordinator: submit each group, then batch"),
                        ("bare", "RemoteEngine alone, the same requests (baseline)")):  # fmt: skip
        us = sorted(c / samples * 1e6 for c, _ in runs[name])
        at = [us[min(len(us) - 1, round(q * (len(us) - 1)))] for q in (0.5, 0.9)] + [us[-1]]
        wall = [w for _, w in runs[name]]
        rows.append([label, *(f"{x:.1f}" for x in at), *stats_ms(wall, (0.5, 0.9))])
    own = statistics.median(c for c, _ in runs["coordinator"]) - statistics.median(
        c for c, _ in runs["bare"]
    )
    head = ("path", "caller CPU us a sample p50", "p90", "max", "wall ms p50", "p90", "max")
    return (
        f"Rollouts: {args.groups} groups of {n} one-token samples ({samples}), the caller's "
        f"CPU a sample ({args.repeat} rounds; the coordinator's own: "
        f"{own / samples * 1e6:.1f} us a sample)\n\n" + table(rows, head)
    )


# -- idle -------------------------------------------------------------------------------------
async def run_idle(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as d:
        tiny().save_pretrained(d)
        procs = [serve(d, f"idle{i}") for i in range(2)]
        engines = [RemoteEngine(url, name=f"idle{i}") for i, (_, url) in enumerate(procs)]
        coord = Coordinator(engines, batch_size=4)
        try:
            pids = [os.getpid(), *(p.pid for p, _ in procs)]
            before = [cpu_seconds(p) for p in pids]
            t0 = time.monotonic()
            await asyncio.sleep(args.idle)  # nothing to do: what does it cost?
            wall = time.monotonic() - t0
            after = [cpu_seconds(p) for p in pids]
        finally:
            await coord.aclose()
            for e in engines:
                await e.aclose()
            for p, _ in procs:
                p.terminate()
                p.wait(30)
    shares = [(a - b) / wall * 100 for a, b in zip(after, before, strict=True)]
    rows = [[name, f"{s:.3f}"] for name, s in zip(
        ["coordinator (this process)", "engine process 1", "engine process 2"], shares,
        strict=True)]  # fmt: skip
    rows.append(["all three", f"{sum(shares):.3f}"])
    return f"Idle for {wall:.1f} s, % of one core\n\n" + table(rows, ("process", "% CPU"))


# -- update cycle ------------------------------------------------------------------------------
async def run_update(args: argparse.Namespace) -> str:
    """The engine in its own process (``rlferry serve engine``), as in a real job: cuda_ipc
    needs the sender and the engine in two processes on one GPU."""
    device = args.device
    make = (lambda s: qwen3_06b(device)) if args.model == "qwen3-0.6b" else (
        lambda s: tiny(s).to(device))  # fmt: skip
    transport = "cuda_ipc" if device.startswith("cuda") else "shm"
    with tempfile.TemporaryDirectory() as d:
        make(0).save_pretrained(d)
        trainer = make(1)
        proc, url = serve(d, "e0", "--device", device)
        engine = RemoteEngine(url, name="e0")
        sender = WeightSender(group="bench", transport=transport, receivers=1)
        try:
            await engine.init_weight_transfer("bench", sender.address)
            rows, step = await _cycles(args, engine, sender, trainer.state_dict())
        finally:
            await engine.aclose()
            sender.close()
            proc.terminate()
            proc.wait(60)
    return (
        f"Update cycle (update_weights), {args.model} on {device}, {transport}; "
        f"one decode step of the running batch: {step:.1f} ms\n\n"
        + table(rows, ("path", "p50 ms", "p99 ms", "max ms"))
    )


async def _cycles(
    args: argparse.Namespace, engine: RemoteEngine, sender: WeightSender, state: dict[str, Any]
) -> tuple[list[list[str]], float]:
    coord = Coordinator([engine], batch_size=8, max_staleness=4)
    version = iter(range(1, 1 << 30))
    bare, idle, busy, step = [], [], [], []

    def push(v: int) -> Any:
        return lambda t: sender.push(state.items(), version=v, timeout=t)

    for _ in range(2):  # warm-up: the plan, the handles, the grouped copies
        v = next(version)
        await coord.update_weights(push(v), version=v)
    for _ in range(args.repeat):
        v = next(version)
        await engine.start_weight_update()  # the bare push, with the engine holding still
        t0 = time.perf_counter()
        await asyncio.to_thread(push(v), 60.0)
        bare.append(time.perf_counter() - t0)
        await engine.finish_weight_update(v)
        coord._bound.version = v  # the bare push moved the version on
        v = next(version)
        idle.append((await coord.update_weights(push(v), version=v)).seconds)
    generating = asyncio.ensure_future(_keep_busy(coord))
    try:
        for _ in range(args.repeat):
            await asyncio.sleep(0.1)  # rollouts under way
            v = next(version)
            before = await engine.statistics()
            busy.append((await coord.update_weights(push(v), version=v)).seconds)
            after = await engine.statistics()
            if after.steps > before.steps:
                step.append(
                    (after.step_seconds - before.step_seconds) / (after.steps - before.steps)
                )
    finally:
        generating.cancel()
        await coord.aclose()
    rows = [
        ["bare WeightSender.push (baseline)", *stats_ms(bare)],
        ["update_weights, engine idle", *stats_ms(idle)],
        ["update_weights, engine generating", *stats_ms(busy)],
    ]
    return rows, (sum(step) / len(step) * 1e3 if step else float("nan"))


async def _keep_busy(coord: Coordinator) -> None:
    params = SamplingParams(max_tokens=64, temperature=1.0)
    while True:
        fut = await coord.submit([1, 2, 3, 4], params, n=4)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        await coord.batch(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/control.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--idle", type=float, default=10.0)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", choices=("tiny", "qwen3-0.6b"), default="tiny")
    p.add_argument("--only", choices=("delivery", "fanout", "rollouts", "idle", "update"),
                   default=None)  # fmt: skip
    a = p.parse_args(argv)
    where = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else platform.node()
    print(f"{where}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}\n", flush=True)  # fmt: skip
    parts: dict[str, Any] = {"delivery": run_delivery, "fanout": run_fanout,
                             "rollouts": run_rollouts, "idle": run_idle,
                             "update": run_update}  # fmt: skip
    for name, fn in parts.items():
        if a.only in (None, name):
            print(asyncio.run(fn(a)) + "\n", flush=True)


if __name__ == "__main__":
    main()
