"""Where the demo's push goes, in every process: stamps merged, a push's steps by median.

Run the demo with ``benchmarks/_stamps`` on ``PYTHONPATH`` and ``RLFERRY_STAMPS=DIR``
(its ``sitecustomize`` calls :func:`install` in every process), then this script on DIR:

    RLFERRY_STAMPS=/tmp/st PYTHONPATH=benchmarks/_stamps rlferry demo --device cuda \\
        --model qwen3-0.6b --steps 40 --engines 1
    python benchmarks/_demo_stamps.py /tmp/st [--show 2]

It prints every push's ms (the trainer's ``WeightSender.push``, or rank 0's
``ShardedSender.push``), ``--show`` pushes in full, and for the pushes after the third
the median time of each stamp from the push's start, with how long the engine's decode
step in flight when the push began still ran. A stamp costs a few microseconds of the
stamping thread: compare stamped runs with stamped runs only.
"""

from __future__ import annotations

import argparse
import builtins
import collections
import glob
import inspect
import os
import statistics
import sys
import threading
import time
from typing import Any

import _trace

# (module, Class.method): a push at both ends, the engine's steps, the trainer's step
TARGETS = [
    ("rlferry.weights.sender._sender", "WeightSender.push"),
    ("rlferry.weights.sharded._sender", "ShardedSender.push"),
    ("rlferry.weights.sender._pusher", "Pusher._push"),
    ("rlferry.weights.sender._pusher", "Pusher._push_here"),
    ("rlferry.weights.sender._finishing", "Finisher.finish"),
    ("rlferry.weights.sender._course", "Course.start"),
    ("rlferry.weights.sender._course", "Course.announce_all"),
    ("rlferry.weights.sender._course", "Course.done"),
    ("rlferry.weights.sender._hub", "Hub.handle"),
    ("rlferry.weights.transports._cuda_ipc", "CudaIpcSender.ready"),
    ("rlferry.weights.transports._cuda_ipc", "CudaIpcReceiver.finish"),
    ("rlferry.weights.copies._copy", "GroupedCopy.__call__"),
    ("rlferry.weights.receiver._connection", "Connection.take_start"),
    ("rlferry.weights.receiver._connection", "Connection.say_committed"),
    ("rlferry.weights.receiver._loading", "Loader.handle"),
    ("rlferry.weights.receiver._loading", "Loader._bucket"),
    ("rlferry.weights.receiver._loading", "Loader._commit"),
    ("rlferry.engines.hf._engine", "HFEngine._load"),
    ("rlferry.engines.hf._thread", "DecodeThread._stop_for_load"),
    ("rlferry.engines.hf._thread", "DecodeThread._on_commit"),
    ("rlferry.engines.hf._thread", "DecodeThread._step"),
    ("rlferry.rl.trainer._step", "TrainStep.__call__"),
]
PUSHES = ("WeightSender.push", "ShardedSender.push")
SKIP = 3  # the first pushes pay one-off costs (plans, handles, compiles)


def install(out_dir: str) -> None:
    """Stamp every target of this process into ``out_dir``, each wrapped once its class
    exists (checked after every import: a module is in ``sys.modules`` before its classes)."""
    os.makedirs(out_dir, exist_ok=True)
    out = open(os.path.join(out_dir, f"{os.getpid()}.log"), "a", buffering=1)  # noqa: SIM115
    pid = os.getpid()

    def stamp(tag: str, name: str) -> None:
        who = threading.current_thread().name.replace(" ", "_")
        out.write(f"{time.perf_counter_ns()} {pid} {who} {tag} {name}\n")

    def wrap_all() -> None:
        for module, qual in TARGETS:
            mod = sys.modules.get(module)
            cls = getattr(mod, qual.split(".")[0], None) if mod is not None else None
            attr = qual.split(".")[1]
            fn = inspect.getattr_static(cls, attr, None) if cls is not None else None
            if fn is None or getattr(fn, "_stamped", False):
                continue
            wrapped = _trace.wrapped(fn, qual, stamp)
            wrapped._stamped = True  # type: ignore[attr-defined]
            setattr(cls, attr, wrapped)

    imported = builtins.__import__

    def importing(*a: Any, **k: Any) -> Any:
        module = imported(*a, **k)
        if "rlferry" in sys.modules:
            wrap_all()
        return module

    builtins.__import__ = importing


def summary(out_dir: str, show: int = 0) -> str:
    """The pushes' ms, ``show`` of them in full, and each stamp's median offset."""
    paths = glob.glob(os.path.join(out_dir, "*.log"))
    if not paths:
        return (
            f"no stamps in {out_dir!r}: run the demo with RLFERRY_STAMPS={out_dir} and "
            "benchmarks/_stamps on PYTHONPATH"
        )
    lines = []
    for path in paths:
        with open(path) as f:
            lines += [(int(x[0]), *x[1:]) for x in map(str.split, f) if len(x) == 5]
    lines.sort()
    role: dict[str, str] = {}
    for _, pid, _, _, name in lines:  # the first process to push is the trainer (rank 0)
        if name in PUSHES and "trainer" not in role.values():
            role[pid] = "trainer"
        elif name == "DecodeThread._step":
            role.setdefault(pid, "engine")
    pushes, begun = [], None
    for t, pid, _, tag, name in lines:
        if name in PUSHES and role.get(pid) == "trainer":
            if tag == "B":
                begun = t
            elif begun is not None:
                pushes.append((begun, t))
                begun = None
    steps = [(t, tag) for t, _, _, tag, name in lines if name == "DecodeThread._step"]
    out = [f"{len(pushes)} pushes, ms: " + " ".join(f"{(e - b) / 1e6:.2f}" for b, e in pushes)]
    offsets: dict[tuple[Any, ...], list[float]] = collections.defaultdict(list)
    in_flight = []
    for i, (b, e) in enumerate(pushes[SKIP:]):
        began = [t for t, tag in steps if tag == "B" and t <= b]
        ends = [t for t, tag in steps if tag == "E" and began and t >= began[-1]]
        in_flight.append((ends[0] - b) / 1e6 if ends and ends[0] > b else 0.0)
        seen: collections.Counter[tuple[str, ...]] = collections.Counter()
        rows = []
        for t, pid, who, tag, name in lines:
            if b - 200_000 <= t <= e + 200_000:
                key = (role.get(pid, "p" + pid), who[:24], tag, name)
                seen[key] += 1
                offsets[(*key, seen[key])].append((t - b) / 1e3)
                rows.append(f"{(t - b) / 1e3:9.1f} us  {key[0]:8} {key[1]:24} {tag} {name}")
        if i < show:
            out += [f"\n== push {SKIP + i}: {(e - b) / 1e6:.2f} ms, the engine's step in "
                    f"flight {in_flight[-1]:.2f} ms more", *rows]  # fmt: skip
    n = len(pushes) - SKIP
    if n <= 0:
        return "\n".join([*out, "too few pushes stamped"])
    busy = [x for x in in_flight if x > 0]
    out += [
        f"\n== {n} pushes from the {SKIP + 1}th: p50 "
        f"{statistics.median((e - b) / 1e6 for b, e in pushes[SKIP:]):.2f} ms; the engine "
        f"was in a step when {len(busy)} began, that step ran on for p50 "
        f"{statistics.median(busy) if busy else 0.0:.2f} ms; each stamp's median, from the "
        "push's start (stamps in half the pushes or more):"
    ]
    rows = [(statistics.median(v), k, len(v)) for k, v in offsets.items() if len(v) >= n / 2]
    out += [f"{m:9.1f} us  n={c:<3} {k[0]:8} {k[1]:24} {k[2]} {k[3]} #{k[4]}"
            for m, k, c in sorted(rows)]  # fmt: skip
    spans = [
        e - b
        for (b, x), (e, y) in zip(steps[::2], steps[1::2], strict=False)
        if (x, y) == ("B", "E")
    ]
    if spans:
        out.append(f"the engine's steps: {len(spans)}, p50 {statistics.median(spans) / 1e6:.2f} ms")
    return "\n".join(out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="RLFERRY_STAMPS's directory of a demo run")
    p.add_argument("--show", type=int, default=0, help="pushes to print in full")
    args = p.parse_args()
    print(summary(args.dir, args.show))
