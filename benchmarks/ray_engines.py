"""An engine as a Ray actor against the same engine in this process: generation and a
weight update, the same workload, the same run.

``HFEngine`` of a random-init Llama (``--hidden``, ``--layers``) serves ``--prompts``
prompts of 16 tokens, ``--tokens`` new tokens each, sampled; then ``--updates`` weight
updates through the coordinator (pause, push, commit, resume): in this process, and as a
Ray actor with its own bundle (``RayEngines``, one GPU with ``--device cuda``) driven over
HTTP. Both use one CPU thread (Ray gives the actor ``OMP_NUM_THREADS=1`` for its one CPU;
two threads on the 2-core VM made the in-process engine 3-5x slower and erratic, the
decode thread fighting OpenMP's). Weights go by ``shm`` on the CPU and by ``cuda_ipc`` on
CUDA (the trainer here, the engine actor on the same GPU: the device is matched by UUID,
whatever the actor's ``CUDA_VISIBLE_DEVICES``). Runs on the CPU and on a one-GPU machine:

    python benchmarks/ray_engines.py [--device cuda] [--prompts 64] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import ray
import torch
import transformers

from rlferry.control import Coordinator, GenerateRequest, RemoteEngine, SamplingParams
from rlferry.engines.hf import HFEngine
from rlferry.ray import RayEngines
from rlferry.weights import WeightSender

from _common import table


def _model(hidden: int, layers: int, seed: int) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=hidden,
                                      num_hidden_layers=layers, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=4 * hidden,
                                      max_position_embeddings=1024)  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


async def _measure(engine: Any, trainer: dict[str, torch.Tensor], transport: str,
                   a: argparse.Namespace) -> tuple[float, list[float]]:  # fmt: skip
    params = SamplingParams(max_tokens=a.tokens, temperature=1.0)
    reqs = [GenerateRequest(request_id=f"r{i}", prompt_ids=list(range(1, 17)), params=params)
            for i in range(a.prompts)]  # fmt: skip
    await asyncio.gather(*(engine.generate(r) for r in reqs[:2]))  # warm
    t0 = time.perf_counter()
    done = await asyncio.gather(*(engine.generate(r) for r in reqs))
    rate = sum(len(c.token_ids) for c in done) / (time.perf_counter() - t0)
    sender = WeightSender(group=f"bench-{id(engine)}", transport=transport, receivers=1)
    coord = Coordinator([engine], batch_size=1, max_staleness=1)
    updates = []
    try:
        await engine.init_weight_transfer(f"bench-{id(engine)}", sender.address)
        for v in range(1, a.updates + 2):
            t1 = time.perf_counter()
            await coord.update_weights(
                lambda t, v=v: sender.push(trainer.items(), version=v, timeout=t), version=v
            )
            updates.append(time.perf_counter() - t1)
    finally:
        await coord.aclose()
        sender.close()
    return rate, updates[1:]  # the first update sends the plan and opens the buffers


BASELINE = {False: "in this process", True: "a process of its own (rlferry serve engine)"}
"""The baseline: in this process on the CPU; on CUDA a process of its own, since cuda_ipc
moves weights between processes (a sender and a receiver in one process cannot open
each other's IPC handles)."""


async def _baseline(
    model_dir: str, cuda: bool, trainer: dict[str, torch.Tensor], transport: str,
    a: argparse.Namespace,
) -> tuple[float, list[float]]:  # fmt: skip
    if not cuda:
        local = HFEngine(model_dir, name="local", device="cpu")
        try:
            return await _measure(local, trainer, transport, a)
        finally:
            local.close()
    cmd = [sys.executable, "-m", "rlferry.cli", "serve", "engine", "--model", model_dir,
           "--name", "local", "--device", "cuda"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    remote = RemoteEngine(proc.stdout.readline().split()[1], name="local")
    try:
        return await _measure(remote, trainer, transport, a)
    finally:
        await remote.aclose()
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/ray_engines.py", description=__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--updates", type=int, default=10)
    a = p.parse_args()
    cuda = a.device == "cuda"
    torch.set_num_threads(1)  # as in the actor: Ray sets OMP_NUM_THREADS to its 1 CPU
    device = "cuda:0" if cuda else "cpu"
    transport = "cuda_ipc" if cuda else "shm"
    trainer = {n: t.to(device) for n, t in _model(a.hidden, a.layers, 1).state_dict().items()}
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        _model(a.hidden, a.layers, 0).save_pretrained(model_dir)
        results = {BASELINE[cuda]: asyncio.run(_baseline(model_dir, cuda, trainer, transport, a))}
        ray.init(num_cpus=4, num_gpus=1 if cuda else 0, include_dashboard=False,
                 log_to_driver=False)  # fmt: skip
        try:
            options = {"device": "cuda" if cuda else "cpu"}
            with RayEngines.start("bench", model_dir, engines=1, gpus_per_engine=int(cuda),
                                  options=options) as started:  # fmt: skip

                async def on_ray() -> tuple[float, list[float]]:
                    try:
                        return await _measure(started.engines[0], trainer, transport, a)
                    finally:
                        await started.engines[0].aclose()

                results["Ray actor (HTTP)"] = asyncio.run(on_ray())
        finally:
            ray.shutdown()
    base_rate = results[BASELINE[cuda]][0]
    for name, (rate, updates) in results.items():
        updates.sort()
        rows.append([name, f"{rate:.0f}", f"{rate / base_rate:.3f}x",
                     f"{1e3 * statistics.median(updates):.1f}",
                     f"{1e3 * updates[int(0.9 * (len(updates) - 1))]:.1f}",
                     f"{1e3 * updates[-1]:.1f}"])  # fmt: skip
    gpu = torch.cuda.get_device_name(0) if cuda else f"{torch.get_num_threads()} CPU threads"
    print(
        f"{platform.node()}, {gpu}, ray {ray.__version__}: Llama {a.layers} x {a.hidden}, "
        f"{a.prompts} prompts x {a.tokens} tokens, {a.updates} updates by {transport}\n"
    )
    print(table(rows, ["engine", "tokens/s", "vs the baseline", "update p50 ms", "p90 ms",
                       "max ms"]))  # fmt: skip


if __name__ == "__main__":
    main()
