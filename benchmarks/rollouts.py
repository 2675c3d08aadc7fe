"""Queue benchmark: PUT and GET between processes, against TransferQueue and a Ray actor.

Workloads are TransferQueue's perftest "small" ones, rebuilt exactly: *simple*
(1024 samples x 9 fields x 8192 float32) and *complex* (3 dense fields, 3
jagged nested fields of lengths 1..8192, 3 string fields of 32768 hex chars).
rlferry: an embedded queue with 2 storage units in this process, a producer
process and a consumer process. In the same run, when ``--tq-python`` names an
interpreter with ``transferqueue`` installed: its own perftest (SimpleStorage,
2 storage units) and its Ray-actor baseline, on a local Ray head. Also: GET
with 1, 8 and 32 fields of the same total bytes, the CPU a blocked get uses,
and how fast it wakes after the put that completes its batch.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from rlferry.queue import GetTimeout, Queue
from rlferry.queue._columns import shared_columns

from _common import gbps, receive, start_worker, table

B, S = 1024, 8192


def simple_case(fields: int = 9, seq_len: int = S) -> dict[str, Any]:
    return {f"field_{i}": torch.randn(B, seq_len) for i in range(fields)}


def complex_case() -> dict[str, Any]:
    step = (S - 1) / (B - 1)
    lengths = [max(1, min(round(1 + j * step), S)) for j in range(B)]
    data: dict[str, Any] = {}
    for i in range(3):
        data[f"field_{i}"] = torch.randn(B, S)
    for i in range(3):
        flat = torch.randn(sum(lengths))
        data[f"nested_field_{i}"] = torch.nested.as_nested_tensor(
            list(torch.split(flat, lengths)), layout=torch.jagged
        )
    for i in range(3):
        data[f"nontensor_field_{i}"] = [os.urandom(S * 2).hex() for _ in range(B)]
    return data


def nbytes(data: dict[str, Any]) -> int:
    total = 0
    for v in data.values():
        if isinstance(v, torch.Tensor):
            total += (v.values() if v.is_nested else v).numel() * 4
        else:
            total += sum(len(s) for s in v)
    return total


def _producer(
    address: str, case: str, fields: int, seq_len: int, iters: int, shm: bool, conn: Connection
) -> None:
    data = complex_case() if case == "complex" else simple_case(fields, seq_len)
    c = Queue.connect(address).client()
    for it in range(iters):
        conn.recv()  # go
        # with shm the producer builds this rollout in shared memory (untimed, as the data is)
        rollout = shared_columns(data) if shm else data
        t0 = time.perf_counter()
        c.put(f"train_{it}", rollout, timeout=120)
        conn.send(time.perf_counter() - t0)
        del rollout  # its memory goes back to the pool once consumed


def _consumer(address: str, names: list[str], iters: int, conn: Connection) -> None:
    c = Queue.connect(address).client()
    for it in range(iters):
        conn.recv()
        t0 = time.perf_counter()
        b = c.get(f"train_{it}", task="train", batch_size=B, fields=names, timeout=120)
        dt = time.perf_counter() - t0
        c.ack(b)
        del b
        conn.send(dt)


def rlferry_put_get(
    case: str, iters: int, fields: int = 9, seq_len: int = S, shm: bool = False
) -> tuple[float, float]:
    """Median PUT and GET seconds of one batch, producer and consumer in their own processes.

    ``shm``: the producer builds each batch in shared memory before the put (so the put
    copies nothing), as a rollout worker can when it makes its tensors.
    """
    names = list((complex_case() if case == "complex" else simple_case(fields, 1)).keys())
    ctx = mp.get_context("spawn")
    with Queue(storage_units=2, tasks=("train",)) as q:
        prod, pp = start_worker(ctx, _producer, q.address, case, fields, seq_len, iters, shm)
        cons, cp = start_worker(ctx, _consumer, q.address, names, iters)
        puts, gets = [], []
        for _ in range(iters):
            pp.send("go")
            puts.append(receive(pp, "the producer's put time"))
            cp.send("go")
            gets.append(receive(cp, "the consumer's get time"))
        prod.join(30)
        cons.join(30)
    # the first two iterations fill the shared-memory pools (fresh pages fault once)
    warm = slice(2, None) if iters > 3 else slice(None)
    return statistics.median(puts[warm]), statistics.median(gets[warm])


def _scan_producer(address: str, widths: list[int], iters: int, conn: Connection) -> None:
    cases = {k: shared_columns(simple_case(k, 73728 // k)) for k in widths}  # puts copy nothing
    c = Queue.connect(address).client()
    for it in range(iters):
        for k in widths:
            conn.recv()
            c.put(f"w{k}_{it}", cases[k], timeout=120)
            conn.send(0.0)


def _scan_consumer(address: str, widths: list[int], iters: int, conn: Connection) -> None:
    c = Queue.connect(address).client()
    names = {k: [f"field_{i}" for i in range(k)] for k in widths}
    for it in range(iters):
        for k in widths:
            conn.recv()
            t0 = time.perf_counter()
            b = c.get(f"w{k}_{it}", task="train", batch_size=B, fields=names[k], timeout=120)
            dt = time.perf_counter() - t0
            c.ack(b)
            del b
            conn.send(dt)


def field_scan(widths: list[int], iters: int) -> dict[int, float]:
    """Median GET seconds of a batch of ``k`` fields (same total bytes) for each ``k``, the
    widths taken in turn within one run so that all of them see the same machine."""
    ctx = mp.get_context("spawn")
    with Queue(storage_units=2, tasks=("train",)) as q:
        (prod, pp), (cons, cp) = (
            start_worker(ctx, _scan_producer, q.address, widths, iters),
            start_worker(ctx, _scan_consumer, q.address, widths, iters),
        )
        times: dict[int, list[float]] = {k: [] for k in widths}
        for _ in range(iters):
            for k in widths:
                pp.send("go")
                receive(pp, f"the producer's put of {k} fields")
                cp.send("go")
                times[k].append(receive(cp, f"the consumer's get of {k} fields"))
        for p in (prod, cons):
            p.join(30)
    warm = slice(2, None) if iters > 3 else slice(None)
    return {k: statistics.median(v[warm]) for k, v in times.items()}


def idle_and_wakeup(block_s: float = 10.0, wakeups: int = 30) -> tuple[float, float]:
    """CPU share of a get blocked ``block_s`` seconds; median ms from put-return to get-return."""
    with Queue(storage_units=1, tasks=("train",)) as q:
        c = q.client()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        with contextlib.suppress(GetTimeout):  # expected: nothing was put; we timed the wait
            c.get("idle", task="train", batch_size=1, fields=["x"], timeout=block_s)
        cpu = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        lat = []

        def wait(part: str, out: list[float], done: threading.Event) -> None:
            c.get(part, task="train", batch_size=1, fields=["x"], timeout=30)
            out.append(time.perf_counter())
            done.set()

        for i in range(wakeups):
            done = threading.Event()
            out: list[float] = []
            t = threading.Thread(target=wait, args=(f"w{i}", out, done))
            t.start()
            while c.statistics().waiting_gets == 0:
                done.wait(0.001)  # allowed: the benchmark waits for the get to park first
            c.put(f"w{i}", {"x": torch.zeros(1)})
            put_done = time.perf_counter()
            done.wait(30)
            t.join()
            lat.append(out[0] - put_done)
    return cpu, statistics.median(lat) * 1e3


def transferqueue(python: str, case: str, iters: int) -> dict[str, float]:
    """TransferQueue's perftest (SimpleStorage, 2 units) and Ray baseline: PUT/GET seconds."""
    site = subprocess.run(
        [
            python,
            "-c",
            "import transfer_queue, os; print(os.path.dirname("
            "os.path.dirname(transfer_queue.__file__)))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    scripts = Path(site) / "scripts" / "performance_test"
    cfg = Path(tempfile.mkdtemp()) / "perftest_config.yaml"
    cfg.write_text(
        "controller:\n  sampler: SequentialSampler\n  polling_mode: False\n"
        "backend:\n  storage_backend: SimpleStorage\n"
        "  SimpleStorage:\n    total_storage_size: 100000\n    num_data_storage_units: 2\n"
    )
    ray = str(Path(python).parent / "ray")
    env = {**os.environ, "RAY_ADDRESS": "auto"}
    subprocess.run([ray, "stop", "--force"], capture_output=True)
    subprocess.run(
        [
            ray,
            "start",
            "--head",
            "--num-cpus=4",
            "--include-dashboard=false",
            '--resources={"node:127.0.0.1":1}',
        ],
        capture_output=True,
        check=True,
    )
    out: dict[str, float] = {}
    try:
        common = [
            "--global_batch_size=1024",
            "--field_num=9",
            "--seq_len=8192",
            f"--num_test_iterations={iters}",
            "--head_node_ip=127.0.0.1",
        ]
        extra = ["--use_complex_case"] if case == "complex" else []
        for label, script, args in (
            (
                "tq",
                "perftest.py",
                [f"--backend_config={cfg}", "--backend=SimpleStorage", "--device=cpu"],
            ),
            ("ray", "ray_perftest_baseline.py", []),
        ):
            run = subprocess.run(
                [python, str(scripts / script), *args, *common, *extra],
                capture_output=True,
                text=True,
                env=env,
                cwd=cfg.parent,
                timeout=1800,
            )
            log = run.stdout + run.stderr
            put = [float(x) for x in re.findall(r"PUT Time: ([\d.]+)s", log)]
            get = [float(x) for x in re.findall(r"GET Time: ([\d.]+)s", log)]
            if not put or not get:
                raise RuntimeError(f"{script} printed no timings:\n{log[-3000:]}")
            warm = slice(1, None) if len(put) > 1 else slice(None)
            out[f"{label}_put"] = statistics.median(put[warm])
            out[f"{label}_get"] = statistics.median(get[warm])
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True)
    return out


def run(iters: int, tq_python: str | None) -> str:
    lines = [
        f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}; rlferry: median of iterations 3..{iters}; "
        f"TransferQueue and Ray: median of iterations 2..{iters}"
    ]
    rows = []
    for case in ("simple", "complex"):
        size = nbytes(complex_case() if case == "complex" else simple_case())
        ours = {
            case: rlferry_put_get(case, iters),
            f"{case}, built in shared memory": rlferry_put_get(case, iters, shm=True),
        }
        tq = transferqueue(tq_python, case, iters) if tq_python else {}
        for name, (put, get) in ours.items():
            rf = (gbps(size, put), gbps(size, get))
            row = [name, f"{size / 1e9:.3f}", f"{rf[0]:.2f}", f"{rf[1]:.2f}"]
            for label in ("tq", "ray"):
                if tq:
                    p, g = gbps(size, tq[f"{label}_put"]), gbps(size, tq[f"{label}_get"])
                    row += [f"{p:.2f} / {g:.2f}", f"{rf[0] / p:.1f}x / {rf[1] / g:.1f}x"]
                else:
                    row += ["not run", ""]
            rows.append(row)
    lines.append(
        table(
            rows,
            (
                "case",
                "GB",
                "rlferry PUT GB/s",
                "rlferry GET GB/s",
                "TransferQueue PUT / GET GB/s",
                "rlferry vs TQ",
                "Ray actor PUT / GET GB/s",
                "rlferry vs Ray",
            ),
        )
    )
    scan = []
    gets = field_scan([1, 8, 32], max(iters, 10) * 6)
    for k, get in gets.items():
        seq = 73728 // k
        rate = gbps(B * seq * k * 4, get)
        scan.append([str(k), str(seq), f"{get * 1e3:.2f}", f"{rate:.2f}", f"{gets[1] / get:.2f}"])
    lines.append(
        "GET of 1, 8 and 32 fields of the same total bytes, built in shared memory, "
        "taken in turn within one run (median of each width's gets but the first two):"
    )
    lines.append(table(scan, ("fields", "seq_len each", "GET ms", "GET GB/s", "x 1-field GET")))
    cpu, wake = idle_and_wakeup()
    lines.append(
        f"blocked get for 10 s: {cpu * 100:.2f}% of one CPU; "
        f"wake-up after the completing put: {wake:.2f} ms median"
    )
    return "\n\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/rollouts.py", description=__doc__)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument(
        "--tq-python",
        default=None,
        help="a python with `pip install transferqueue` (brings ray): runs the anchors",
    )
    a = p.parse_args(argv)
    print(run(a.iterations, a.tq_python), flush=True)


if __name__ == "__main__":
    main()
