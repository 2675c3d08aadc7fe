"""Job start on Ray: cluster ready -> first rollout, rlferry against TransferQueue 0.1.11.

One local Ray head (``ray.cluster_utils.Cluster``, 16 logical CPUs) serves every run.
Each run is a fresh driver process that connects to it (the clock starts once
``ray.init`` returned: the cluster is ready), starts the queue on Ray, puts one rollout
(``--rows`` samples: ``input_ids`` and ``responses`` of 512 int64 tokens, ``rewards``),
gets it back whole, and exits (Ray removes its job's actors). The two take turns.

- rlferry: ``RayQueue.start(job, storage_units=2)`` then ``rlferry.ray.queue(job)``'s
  ``put`` and ``get`` (this interpreter).
- TransferQueue: ``tq.init()`` (its default: a controller and 2 SimpleStorage units as
  Ray actors) then ``kv_batch_put`` and ``kv_batch_get`` (``--tq-python``: an interpreter
  with ``transferqueue==0.1.11``, e.g. ``python -m venv .venv-tq && .venv-tq/bin/pip
  install torch==2.13.0 transferqueue==0.1.11``; its job's workers run that interpreter,
  through Ray's ``runtime_env={"py_executable": ...}``).

    python benchmarks/ray_start.py [--runs 5] [--tq-python .venv-tq/bin/python]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

from ray.cluster_utils import Cluster

from _common import table

_RLFERRY = """
import json, sys, time
import ray, torch
ray.init(address=sys.argv[1], log_to_driver=False)
t0 = time.perf_counter()
from rlferry.ray import RayQueue, queue
q = RayQueue.start("start", storage_units=2)
t1 = time.perf_counter()
client = queue("start")
rows = int(sys.argv[2])
data = {"input_ids": torch.randint(0, 1000, (rows, 512)),
        "responses": torch.randint(0, 1000, (rows, 512)), "rewards": torch.rand(rows)}
client.put("train_0", data)
batch = client.get("train_0", task="train", batch_size=rows, fields=list(data), timeout=60)
t2 = time.perf_counter()
assert torch.equal(batch.data["responses"], data["responses"])
print(json.dumps({"start": t1 - t0, "first": t2 - t0}))
"""

_TQ = """
import json, sys, time
import ray, torch
# this job's workers run this interpreter (the cluster's default lacks transferqueue)
ray.init(address=sys.argv[1], log_to_driver=False, runtime_env={"py_executable": sys.executable})
t0 = time.perf_counter()
import transfer_queue as tq
from tensordict import TensorDict
tq.init()
t1 = time.perf_counter()
rows = int(sys.argv[2])
keys = [f"k{i}" for i in range(rows)]
data = TensorDict({"input_ids": torch.randint(0, 1000, (rows, 512)),
                   "responses": torch.randint(0, 1000, (rows, 512)),
                   "rewards": torch.rand(rows)}, batch_size=rows)
tq.kv_batch_put(keys=keys, partition_id="train", fields=data)
got = tq.kv_batch_get(keys=keys, partition_id="train")
t2 = time.perf_counter()
responses = got["responses"]  # a fixed-shape field may come back jagged
if responses.is_nested:
    responses = torch.stack(list(responses.unbind()))
assert torch.equal(responses, data["responses"])
print(json.dumps({"start": t1 - t0, "first": t2 - t0}))
tq.close()
"""


def _driver(python: str, code: str, address: str, rows: int) -> dict[str, float]:
    out = subprocess.run([python, "-c", textwrap.dedent(code), address, str(rows)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{python}: exit {out.returncode}: {out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/ray_start.py", description=__doc__)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--rows", type=int, default=64)
    default_tq = Path(__file__).resolve().parent.parent / ".venv-tq" / "bin" / "python"
    p.add_argument("--tq-python", default=str(default_tq))
    a = p.parse_args()
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 16, "include_dashboard": False})  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {"rlferry": [], "transferqueue": []}
    try:
        for _ in range(a.runs):
            runs["rlferry"].append(_driver(sys.executable, _RLFERRY, cluster.address, a.rows))
            runs["transferqueue"].append(_driver(a.tq_python, _TQ, cluster.address, a.rows))
    finally:
        cluster.shutdown()
    rows = []
    base = statistics.median(r["first"] for r in runs["transferqueue"])
    for name, rs in runs.items():
        start = sorted(r["start"] for r in rs)
        first = sorted(r["first"] for r in rs)
        rows.append([name, f"{statistics.median(start):.2f}", f"{statistics.median(first):.2f}",
                     f"{first[-1]:.2f}", f"{base / statistics.median(first):.2f}x"])  # fmt: skip
    print(f"{platform.node()}, {a.runs} runs each, one rollout of {a.rows} samples\n")
    print(table(rows, ["", "queue started, p50 s", "first rollout got, p50 s", "max s",
                       "speed vs TransferQueue (p50)"]))  # fmt: skip


if __name__ == "__main__":
    main()
