"""The planner's prediction against measured sharded updates.

Reads the JSON lines of ``benchmarks/weights_sharded.py --json OUT`` and, for each
point-to-point run and each ``--mode bound`` run on GPUs, predicts the update with
``rlferry.weights.predict`` (the same plan code that moved the bytes) on a cluster of
those ranks on one host, every link at ``--nvlink-gbytes`` (the bandwidth NCCL's own
send and receive reached on that machine, not the nominal one), plus ``--update-ms``
per update, ``--link-ms`` per further link of a rank at either end and ``--bucket-ms``
per further bucket (the library's, or what the machine's one-rank-to-one 4 MB update
took: ``--update-ms``; a cuda_ipc run, whose trainer GPUs write, with the library's
costs of writes). A run with ``--bucket-mb`` is predicted with its buckets. A
bound run moves bytes only: it is predicted without the update's cost. A run whose
ranks shared GPUs (``--gpus``) is predicted with its busiest GPU's bytes. Prints
measured p50 (updates 2 on), predicted, and their ratio.

    python benchmarks/plan_check.py RUNS.jsonl --nvlink-gbytes 356
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from rlferry.weights import Cluster, TensorSpec, predict
from rlferry.weights._predict import (
    BUCKET_MS,
    LINK_MS,
    UPDATE_MS,
    WRITE_LINK_MS,
    WRITE_UPDATE_MS,
)

import _weights_engine as eng
from _common import table


def specs_of(run: dict) -> list[TensorSpec]:
    """The run's model: its ``model`` and ``scale``, or the scale whose bytes it moved."""
    model = run.get("model", "qwen3-8b")
    scales = [run["scale"]] if "scale" in run else [1, 2, 4, 8, 16, 32, 64, 128]
    for scale in scales:
        specs = [TensorSpec(n, s, torch.bfloat16) for n, s in eng.model_shapes(model, scale)]
        if sum(s.nbytes for s in specs) == run["model_bytes"]:
            return specs
    raise SystemExit(f"no scale of {model} has {run['model_bytes']} bytes (a run of another model)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/plan_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("runs", help="JSON lines of benchmarks/weights_sharded.py")
    p.add_argument("--nvlink-gbytes", type=float, required=True, help="GB/s per GPU, measured")
    p.add_argument(
        "--update-ms", type=float, default=UPDATE_MS,
        help=f"what an update costs besides its bytes (default {UPDATE_MS}: the library's)",
    )  # fmt: skip
    p.add_argument(
        "--link-ms", type=float, default=LINK_MS,
        help=f"and per further link of a rank, at either end (default {LINK_MS}: the library's)",
    )  # fmt: skip
    p.add_argument(
        "--bucket-ms", type=float, default=BUCKET_MS,
        help=f"and per further bucket of a rank (default {BUCKET_MS}: the library's)",
    )  # fmt: skip
    a = p.parse_args(argv)
    rows = []
    with open(a.runs) as f:
        runs = [json.loads(line) for line in f]
    for run in runs:
        bound = run["mode"] == "bound"
        if run["device"] != "cuda" or not (bound or run.get("point_to_point")):
            continue
        tp = run["tp"]
        costs = (0.0, 0.0, 0.0) if bound else (a.update_ms, a.link_ms, a.bucket_ms)
        if run["transport"] == "cuda_ipc":  # the trainer's GPUs write: the writes' costs
            costs = (WRITE_UPDATE_MS, WRITE_LINK_MS, 0.0)
        cluster = Cluster(
            fsdp=run["senders"], engines=run["receivers"] // tp, engine_tp=tp,
            engine_dtype=torch.bfloat16, nvlink_GBps=a.nvlink_gbytes,
            update_ms=costs[0], link_ms=costs[1], bucket_ms=costs[2],
        )  # fmt: skip
        p = predict(specs_of(run), cluster)
        if run.get("bucket_bytes") and not bound:  # its buckets: the budget that makes them
            links = max(p.trainer_links, p.engine_links)
            cluster = dataclasses.replace(cluster, buffer_bytes=2 * links * run["bucket_bytes"])
            p = predict(specs_of(run), cluster)
        pred = p.seconds
        if run.get("gpus"):  # ranks shared GPUs: the busiest GPU's bytes bound it
            pred += run["busiest_gpu_bytes"] / (a.nvlink_gbytes * 1e9) - p.link_seconds
        got = statistics.median(run["seconds"][1:])
        rows.append([
            f"{run['model_bytes'] / 1e6:,.1f}",
            f"{run['senders']} -> {run['receivers']} (TP {tp})"
            + (f", {run['gpus']} GPUs" if run.get("gpus") else "")
            + (f", {run['bucket_bytes'] >> 20} MiB buckets" if run.get("bucket_bytes") else ""),
            "NCCL send/recv (bound)" if bound
            else "rlferry, cuda_ipc writes" if run["transport"] == "cuda_ipc"
            else "rlferry point to point",
            f"{got * 1e3:.1f}", f"{pred * 1e3:.1f}", f"{got / pred:.2f}",
        ])  # fmt: skip
    header = ["model MB", "ranks", "path", "measured p50 ms", "predicted ms", "measured/predicted"]
    print(table(rows, header))


if __name__ == "__main__":
    main()
