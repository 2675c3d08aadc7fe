"""Death -> named error at the waiting caller, on a local Ray: p50 and max over ``--kills``.

- **Queue**: a get parked at the controller (its partition empty); the controller actor is
  killed (``ray.kill``); the time until the caller holds ``ServiceGone`` naming the actor
  and Ray's reason. A fresh queue (one storage unit) per kill.
- **Engine**: a generate waiting in a paused ``HFEngine`` actor (a tiny random-init
  Llama); the actor is killed; the time until the caller holds ``EngineError`` naming the
  actor and Ray's reason. A fresh engine per kill; then again with one restartable actor
  (``max_restarts``) that serves again after each kill (``RayEngines.restarted``).

The clock starts just before ``ray.kill`` (which only asks Ray; the process dies a little
later), so each figure bounds the delay from the death itself.

    python benchmarks/ray_deaths.py [--kills 20]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import platform
import tempfile
import time

import ray
import torch
import transformers

from rlferry.control import EngineError, GenerateRequest, SamplingParams
from rlferry.queue import ServiceGone
from rlferry.ray import RayEngines, RayQueue

from _common import table


def queue_deaths(kills: int) -> tuple[list[float], str]:
    out, message = [], ""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for k in range(kills):
            with RayQueue.start(f"deaths{k}", storage_units=1, cpus_per_unit=0.5) as q:
                client = q.client()
                client.put("warm", {"x": torch.zeros(1)})
                parked = pool.submit(client.get, "empty", task="train", batch_size=1,
                                     fields=["x"], timeout=60)  # fmt: skip
                client.statistics()  # the get is parked once the controller answers this
                t0 = time.perf_counter()
                ray.kill(q.actors[q.names[0]])
                try:
                    parked.result(timeout=60)
                except ServiceGone as e:
                    out.append(time.perf_counter() - t0)
                    message = str(e)
    return out, message


async def _engine_death(started: RayEngines, restart: bool) -> tuple[float, str]:
    request = GenerateRequest(request_id="r", prompt_ids=[1, 2, 3], params=SamplingParams())
    engine = started.engines[0]
    await engine.pause("keep")
    waiting = asyncio.ensure_future(engine.generate(request))
    await engine.statistics()  # answered after the generate was sent
    t0 = time.perf_counter()
    ray.kill(started.actors[started.names[0]], no_restart=not restart)
    try:
        await asyncio.wait_for(waiting, 60)
    except EngineError as e:
        seconds, message = time.perf_counter() - t0, str(e)
    if restart:
        await started.restarted(0)
    await started.engines[0].aclose()
    return seconds, message


def engine_deaths(kills: int, restart: bool) -> tuple[list[float], str]:
    """A fresh engine actor per kill; with ``restart``, one actor that Ray restarts."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128)  # fmt: skip
    out, message = [], ""
    options = {"device": "cpu"}
    with tempfile.TemporaryDirectory() as model_dir:
        transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
        for k in range(1 if restart else kills):
            with RayEngines.start(f"deaths{k}", model_dir, engines=1, cpus_per_engine=0.5,
                                  max_restarts=kills if restart else 0,
                                  options=options) as started:  # fmt: skip
                for _ in range(kills if restart else 1):
                    seconds, message = asyncio.run(_engine_death(started, restart))
                    out.append(seconds)
    return out, message


def _row(what: str, xs: list[float], kills: int) -> list[str]:
    xs = sorted(xs)
    p50 = xs[len(xs) // 2]
    return [what, f"{len(xs)}/{kills}", f"{1e3 * p50:.1f}", f"{1e3 * xs[-1]:.1f}"]


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/ray_deaths.py", description=__doc__)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--cases", default="queue,engine,restartable", help="which to run")
    a = p.parse_args()
    cases = {
        "queue": ("queue: parked get, controller killed", lambda: queue_deaths(a.kills)),
        "engine": ("engine: waiting generate, engine actor killed",
                   lambda: engine_deaths(a.kills, restart=False)),
        "restartable": ("engine: the same, restartable (max_restarts)",
                        lambda: engine_deaths(a.kills, restart=True)),
    }  # fmt: skip
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        for case in a.cases.split(","):
            results[case] = cases[case][1]()
    finally:
        ray.shutdown()
    print(f"{platform.node()}, ray {ray.__version__}, {a.kills} kills each\n")
    rows = [_row(cases[c][0], xs, a.kills) for c, (xs, _) in results.items()]
    print(table(rows, ["caller", "named errors", "p50 ms", "max ms"]) + "\n")
    for case, (_, message) in results.items():
        print(f"{case}: {message}")


if __name__ == "__main__":
    main()
