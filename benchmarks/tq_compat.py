"""TransferQueue's API, in one run: rlferry's shim (embedded, and as a service on Ray) and
TransferQueue 0.1.11.

The same worker code runs in turn through ``import transfer_queue``: with rlferry's shim
installed (this interpreter), embedded (in the worker's process); with the shim as a
service (``--service``: the worker starts a local Ray, ``ray.init(num_cpus=16)``, and its
``tq.init()`` starts the queue's service actor, which the worker reaches over ipc:// and
shared memory, as every process of the actor's node does); and with the real package
(``--tq-python``: an interpreter with ``transferqueue==0.1.11``; default ``tq.init()`` on a
local Ray started the same way: its controller and storage units are Ray actors).

1. TransferQueue's perftest workload (its ``scripts/performance_test/perftest.py`` "simple"
   case: 1024 samples x 9 float32 fields x 8192, 288 MiB) through its KV API:
   ``kv_batch_put`` then ``kv_batch_get`` of every key, a fresh partition per iteration.
2. The KV calls at metadata speed: ``kv_batch_put``, ``kv_batch_get`` and ``kv_clear`` of N
   samples, one int64 field and a string key each (N = 1: the call's fixed cost; 1,024;
   16,384), a fresh partition per repetition; and ``kv_batch_put`` / ``kv_batch_get`` of 64
   samples x 1 MiB (one float32 field).
3. Metadata cost: tiny samples (one int64 each) through the client, 1k to 131k samples per
   call: ``put`` (new samples), ``get_meta`` (fetch, one task), ``get_data``,
   ``clear_samples``; microseconds per sample.

    python benchmarks/tq_compat.py --service --tq-python .venv-tq/bin/python

Note what differs: the shim's embedded backend keeps the data in the caller's process (a
put is one copy in memory); its service and TransferQueue move it to another process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

B, FIELDS, SEQ = 1024, 9, 8192
SIZES = (1024, 4096, 16384, 65536, 131072)
KV_SIZES = (1, 1024, 16384)
BIG_N, BIG_ROW = 64, 2**20 // 4  # 64 samples x 1 MiB of float32


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "p50": statistics.median(s),
        "p90": s[min(len(s) - 1, round(0.9 * (len(s) - 1)))],
        "max": s[-1],
    }


def kv_calls(tq: Any, reps: int) -> dict[str, Any]:
    """The KV section: seconds per call of put/get/clear at each of ``KV_SIZES`` keys, and
    of put/get of 64 x 1 MiB (``reps`` each after one warm-up, two for 64 x 1 MiB; 1 key: 50
    after 10)."""
    import torch
    from tensordict import TensorDict

    def rounds(name: str, n: int, data: Any, warm: int, runs: int) -> dict[str, list[float]]:
        keys = [f"{name}_{i}" for i in range(n)]
        times: dict[str, list[float]] = {"put": [], "get": [], "clear": []}
        for r in range(warm + runs):
            pid = f"{name}_{n}_{r}"
            t0 = time.perf_counter()
            tq.kv_batch_put(keys=keys, partition_id=pid, fields=data)
            t1 = time.perf_counter()
            got = tq.kv_batch_get(keys=keys, partition_id=pid)
            t2 = time.perf_counter()
            tq.kv_clear(keys=keys, partition_id=pid)
            t3 = time.perf_counter()
            x = got["x"].values() if got["x"].is_nested else got["x"]  # rows of 1 MiB: jagged
            assert torch.equal(x.reshape(-1), data["x"].reshape(-1))
            if r >= warm:
                for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    times[k].append(dt)
        return times

    out: dict[str, Any] = {}
    for n in KV_SIZES:  # 1 key: the fixed cost, the median of 50 calls at least, after 10
        data = TensorDict({"x": torch.arange(n)}, batch_size=n)
        out[str(n)] = rounds("key", n, data, 1 if n > 1 else 10, reps if n > 1 else max(reps, 50))
    data = TensorDict({"x": torch.randn(BIG_N, BIG_ROW)}, batch_size=BIG_N)
    out["big"] = rounds("big", BIG_N, data, 2, reps)  # the first jagged gets are slow
    return out


def worker(impl: str, iters: int, reps: int, sizes: list[int]) -> dict[str, Any]:
    """Runs in the interpreter under test; ``impl`` is 'shim', 'service' or 'tq'."""
    import torch

    if impl != "tq":
        import rlferry.compat.transferqueue as shim

        shim.install()
    if impl != "shim":
        import ray

        ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)
    import transfer_queue as tq
    from tensordict import TensorDict

    tq.init()
    out: dict[str, Any] = {"perftest": {"put": [], "get": []}, "meta": {}}
    out["kv"] = kv_calls(tq, reps)
    data = TensorDict({f"field_{i}": torch.randn(B, SEQ) for i in range(FIELDS)}, batch_size=B)
    keys = [f"key_{i}" for i in range(B)]
    for it in range(iters + 1):  # the first iteration warms up
        pid = f"perftest_{it}"
        t0 = time.perf_counter()
        tq.kv_batch_put(keys=keys, partition_id=pid, fields=data)
        t1 = time.perf_counter()
        got = tq.kv_batch_get(keys=keys, partition_id=pid)
        t2 = time.perf_counter()
        assert got.batch_size[0] == B
        del got
        tq.kv_clear(keys=keys, partition_id=pid)
        if it:
            out["perftest"]["put"].append(t1 - t0)
            out["perftest"]["get"].append(t2 - t1)
    client = tq.get_client()
    for n in sizes:
        times: dict[str, list[float]] = {"put": [], "get_meta": [], "get_data": [], "clear": []}
        tiny = TensorDict({"x": torch.arange(n)}, batch_size=n)
        for r in range(reps + 1):
            pid = f"meta_{n}_{r}"
            t0 = time.perf_counter()
            client.put(data=tiny, partition_id=pid)
            t1 = time.perf_counter()
            meta = client.get_meta(data_fields=["x"], batch_size=n, partition_id=pid,
                                   task_name="train")  # fmt: skip
            t2 = time.perf_counter()
            got = client.get_data(meta)
            t3 = time.perf_counter()
            client.clear_samples(meta)
            t4 = time.perf_counter()
            assert got["x"].reshape(-1).sum().item() == n * (n - 1) // 2
            client.clear_partition(pid)
            if r:
                for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    times[k].append(dt / n * 1e6)
        out["meta"][n] = times
    tq.close()
    return out


def _run(python: str, impl: str, iters: int, reps: int, sizes: list[int]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        args = [python, os.path.abspath(__file__), "--worker", impl, "--json", f.name,
                "--iterations", str(iters), "--reps", str(reps),
                "--sizes", ",".join(map(str, sizes))]  # fmt: skip
        done = subprocess.run(args, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"{impl} worker failed:\n{done.stderr[-4000:]}")
        with open(f.name) as fh:
            result: dict[str, Any] = json.load(fh)
            return result


NAMES = {"shim": "embedded", "service": "service", "tq": "TQ"}


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.2f}x" if b / a < 10 else f"{b / a:.0f}x"


def report(results: dict[str, dict[str, Any]], reps: int) -> str:
    """A table per workload: each implementation's numbers, then each one's speed against
    the embedded shim (>1x: faster) and the shim's against TransferQueue."""
    from _common import table

    nbytes = B * FIELDS * SEQ * 4
    names = [NAMES[k] for k in results]
    lines = [
        f"machine: {platform.node()} ({os.cpu_count()} CPUs), python {platform.python_version()}",
        f"perftest simple case: {B} samples x {FIELDS} fields x {SEQ} float32 "
        f"= {nbytes / 2**20:.0f} MiB; GB/s and samples/s from p50 (p50/p90/max seconds)",
        "",
    ]
    others = [k for k in results if k not in ("shim", "tq")]
    rows = []
    for op in ("put", "get"):
        stats = {k: _stats(r["perftest"][op]) for k, r in results.items()}
        row = [f"kv_batch_{op}"]
        for s in stats.values():
            row += [f"{nbytes / s['p50'] / 1e9:.2f} GB/s, {B / s['p50']:,.0f}/s",
                    f"{s['p50']:.3f}/{s['p90']:.3f}/{s['max']:.3f}"]  # fmt: skip
        row += [_ratio(stats[k]["p50"], stats["shim"]["p50"]) for k in others]
        if "tq" in stats:
            row += [_ratio(stats[k]["p50"], stats["tq"]["p50"]) for k in results if k != "tq"]
        rows.append(row)
    header = ["op"]
    for n in names:
        header += [n, f"{n} s p50/p90/max"]
    header += [f"{NAMES[k]}/embedded speed" for k in others]
    if "tq" in results:
        header += [f"{NAMES[k]}/TQ speed" for k in results if k != "tq"]
    lines += [table(rows, header), ""]
    lines += [kv_report(results, reps), ""]
    lines.append(f"metadata cost, us per sample (tiny int64 samples, {reps} reps: p50 [p90, max])")
    rows = []
    for n in results["shim"]["meta"]:
        for op in ("put", "get_meta", "get_data", "clear"):
            stats = {k: _stats(r["meta"][n][op]) for k, r in results.items()}
            row = [str(n), op]
            row += [f"{s['p50']:.3f} [{s['p90']:.3f}, {s['max']:.3f}]" for s in stats.values()]
            if "tq" in stats:
                row += [_ratio(stats[k]["p50"], stats["tq"]["p50"]) for k in results if k != "tq"]
            rows.append(row)
    header = ["samples", "op", *[f"{n} us/sample" for n in names]]
    if "tq" in results:
        header += [f"{NAMES[k]}/TQ speed" for k in results if k != "tq"]
    lines.append(table(rows, header))
    return "\n".join(lines)


def kv_report(results: dict[str, dict[str, Any]], reps: int) -> str:
    """The KV section's table: us per sample (per call at 1 key), p50 [max] of ``reps``."""
    from _common import table

    rows = []
    for n in map(str, KV_SIZES):
        for op in ("put", "get", "clear"):
            stats = {k: _stats(r["kv"][n][op]) for k, r in results.items()}
            scale = 1e6 / int(n)
            row = [f"kv_batch_{op}" if op != "clear" else "kv_clear", n]
            row += [f"{s['p50'] * scale:.3f} [{s['max'] * scale:.3f}]" for s in stats.values()]
            if "tq" in stats:
                row += [_ratio(stats[k]["p50"], stats["tq"]["p50"]) for k in results if k != "tq"]
            rows.append(row)
    nbytes = BIG_N * BIG_ROW * 4
    for op in ("put", "get"):
        stats = {k: _stats(r["kv"]["big"][op]) for k, r in results.items()}
        row = [f"kv_batch_{op}", f"{BIG_N} x 1 MiB"]
        row += [
            f"{s['p50'] * 1e3:.2f} ms ({nbytes / s['p50'] / 1e9:.2f} GB/s)" for s in stats.values()
        ]
        if "tq" in stats:
            row += [_ratio(stats[k]["p50"], stats["tq"]["p50"]) for k in results if k != "tq"]
        rows.append(row)
    header = ["call", "keys", *[f"{NAMES[k]}: us/key p50 [max]" for k in results]]
    if "tq" in results:
        header += [f"{NAMES[k]}/TQ speed" for k in results if k != "tq"]
    title = (
        f"KV calls, one int64 field and a string key a sample ({reps} reps; 1 key: us a call, "
        f"{max(reps, 50)} reps)"
    )
    return title + "\n" + table(rows, header)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tq-python", help="an interpreter with transferqueue==0.1.11 installed")
    p.add_argument("--iterations", type=int, default=4, help="perftest iterations (after one)")
    p.add_argument("--reps", type=int, default=5, help="metadata-cost repetitions per size")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--service", action="store_true", help="also the shim as a Ray service")
    p.add_argument("--worker", choices=["shim", "service", "tq"], help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.worker:
        with open(a.json, "w") as f:
            json.dump(worker(a.worker, a.iterations, a.reps, sizes), f)
        return
    results = {"shim": _run(sys.executable, "shim", a.iterations, a.reps, sizes)}
    if a.service:
        results["service"] = _run(sys.executable, "service", a.iterations, a.reps, sizes)
    if a.tq_python:
        results["tq"] = _run(a.tq_python, "tq", a.iterations, a.reps, sizes)
    print(report(results, a.reps), flush=True)


if __name__ == "__main__":
    main()
