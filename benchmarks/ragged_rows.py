"""A step of the demo's rollouts through the queue: ragged columns as RaggedRows against
the same rows as a plain list of tensors, in the same run.

The batch: 64 GRPO groups of 8 samples (the demo's on CUDA), prompts of 5-9 tokens,
responses of 1-12; ``rollout_columns`` makes its columns (RaggedRows), the baseline gives
the same tensors as a plain list. This process puts each batch into an embedded queue
(one storage unit); a consumer process, told once the put returned, gets it whole with
``GrpoGroups`` and pads it (``PaddedBatch.of``), as a trainer rank does; for the
baseline it pads the rows as a plain list. Printed: p50, p90 and max of the put, the get
and the padding, and the ratio of the baselines' p50. The get is the same either way (a
ragged column arrives as RaggedRows whatever was put): the row-by-row get it replaced is
an older tree's, measured against it in RESULTS.md.

    python benchmarks/ragged_rows.py --iterations 60
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from rlferry.control import Completion, Group, rollout_columns
from rlferry.queue import GrpoGroups, Queue, QueueClient
from rlferry.rl.grpo import GrpoBatch, PaddedBatch

FIELDS = ["prompt_ids", "response_ids", "logprobs", "advantages"]


def batch(step: int, rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    groups = []
    for k in range(64):
        prompt = [rng.randrange(13) for _ in range(rng.randint(5, 9))]
        done = []
        for i in range(8):
            n = rng.randint(1, 12)
            done.append(Completion(
                request_id=f"{step}-{k}-{i}", prompt_ids=prompt,
                token_ids=[rng.randrange(13) for _ in range(n)],
                logprobs=[-rng.random() for _ in range(n)], versions=[step] * n,
                finish_reason="stop",
            ))  # fmt: skip
        groups.append(Group(group=step * 64 + k, prompt_ids=prompt, completions=done))
    data, meta = rollout_columns(groups)
    data["advantages"] = torch.randn(512)
    return data, meta


def consumer(address: str, conn: Connection) -> None:
    torch.set_num_threads(1)
    client = QueueClient(address)
    while (partition := conn.recv()) is not None:
        t0 = time.perf_counter()
        got = client.get(partition, task="train", batch_size=512, fields=FIELDS,
                         sampler=GrpoGroups(group_size=8), timeout=60)  # fmt: skip
        d = got.data
        if partition.startswith("list"):  # rows as a plain list: padded row by row
            d = {k: list(v) if isinstance(v, list) else v for k, v in d.items()}
        t1 = time.perf_counter()
        PaddedBatch.of(GrpoBatch(d["prompt_ids"], d["response_ids"], d["logprobs"],
                                 d["advantages"]), width=32)  # fmt: skip
        t2 = time.perf_counter()
        client.ack(got)
        conn.send((t1 - t0, t2 - t1))
    client.close()


def figures(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[int(0.9 * (len(xs) - 1))], xs[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    times: dict[str, dict[str, list[float]]] = {
        kind: {"put": [], "get": [], "pad": []} for kind in ("RaggedRows", "list")
    }
    with Queue(storage_units=1, tasks=("train",)) as queue:
        client = queue.client()
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        proc = ctx.Process(target=consumer, args=(queue.address, there))
        proc.start()
        for i in range(args.iterations + 2):  # two warm-up rounds
            data, meta = batch(i, rng)
            for kind in times:  # alternated: both see the same machine
                cols = data if kind == "RaggedRows" else {
                    k: list(v) if isinstance(v, list) else v for k, v in data.items()
                }  # fmt: skip
                partition = f"{kind}_{i}"
                t0 = time.perf_counter()
                client.put(partition, cols, meta=meta, timeout=60)
                put = time.perf_counter() - t0
                here.send(partition)
                get, pad = here.recv()
                if i >= 2:
                    for name, t in (("put", put), ("get", get), ("pad", pad)):
                        times[kind][name].append(t)
                client.clear(partition)
        here.send(None)
        proc.join(30)
        client.close()
    print(f"{args.iterations} batches of 512 samples (64 groups x 8), ms p50 / p90 / max")
    for name in ("put", "get", "pad"):
        row = []
        for kind in times:
            p50, p90, top = figures(times[kind][name])
            row.append(f"{kind} {1e3 * p50:.2f} / {1e3 * p90:.2f} / {1e3 * top:.2f}")
        ratio = statistics.median(times["list"][name]) / statistics.median(
            times["RaggedRows"][name]
        )
        print(f"{name:>4}: " + "   ".join(row) + f"   (list / RaggedRows: {ratio:.2f}x)")


if __name__ == "__main__":
    main()
