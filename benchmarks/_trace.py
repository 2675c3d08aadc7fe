"""Wall-clock stamps of a push's steps in every process, for ``weights_sharded.py --trace``.

Each process of a run wraps the functions below (their entry and exit, with the thread's
name) and appends a line a stamp to ``DIR/<pid>.log``; ``time.perf_counter_ns`` is the
same clock in every process of a host, so the lines of all processes merge into one
timeline. :func:`timeline` prints one update of it (relative to trainer rank 0's
``ShardedSender.push``). A stamp costs a few microseconds: compare traced runs with
traced runs only.
"""

from __future__ import annotations

import functools
import glob
import importlib
import inspect
import os
import threading
import time
from typing import Any

# (module, function or Class.method): the steps of a push, at both ends
TARGETS = [
    ("rlferry.weights.sharded._sender", "ShardedSender.push"),
    ("rlferry.weights.sharded._ready", "Ready.__init__"),
    ("rlferry.weights.sharded._ready", "Ready.__call__"),
    ("rlferry.weights.sharded._ready", "Guard.__call__"),
    ("rlferry.weights.sender._pusher", "Pusher._push"),
    ("rlferry.weights.sender._finishing", "Finisher.finish"),
    ("rlferry.weights.sender._course", "Course.begin"),
    ("rlferry.weights.sender._hub", "Hub.handle"),
    ("rlferry.weights.copies._pack", "Packer.pack"),
    ("rlferry.weights.copies._copy", "GroupedCopy.__call__"),
    ("rlferry.weights.transports._distributed_sender", "DistributedSender.stream"),
    ("rlferry.weights.transports._distributed_receiver", "DistributedReceiver.stream"),
    ("rlferry.weights.transports._distributed_sender", "settled"),
    ("rlferry.weights.transports._distributed_receiver", "settled"),
    ("rlferry.weights.sender._preparing", "Preparer.setups"),
    ("rlferry.weights.sender._course", "Course.start"),
    ("rlferry.weights.transports._cuda_ipc", "CudaIpcSender.use_direct"),
    ("rlferry.weights.transports._cuda_ipc", "CudaIpcSender.ready"),
    ("rlferry.weights.transports._cuda_ipc", "CudaIpcReceiver.finish"),
    ("rlferry.weights.receiver._loading", "Loader.handle"),
    ("rlferry.weights.receiver._loading", "Loader._bucket"),
    ("rlferry.weights.receiver._loading", "Loader._commit"),
    ("rlferry.weights.receiver._loading", "Loader.send"),
    ("rlferry.weights.sharded._receiver", "ShardedReceiver._load"),
    ("rlferry.weights.sharded._receiver", "ShardedReceiver.wait_for"),
    ("rlferry.wire._sync_client", "Client._pump"),
]


def install(out_dir: str) -> None:
    """Stamp every target's entry and exit in this process, into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    out = open(os.path.join(out_dir, f"{os.getpid()}.log"), "a", buffering=1)  # noqa: SIM115
    pid = os.getpid()

    def stamp(tag: str, name: str) -> None:
        who = threading.current_thread().name.replace(" ", "_")
        out.write(f"{time.perf_counter_ns()} {pid} {who} {tag} {name}\n")

    for module, qual in TARGETS:
        owner: Any = importlib.import_module(module)
        cls, _, attr = qual.rpartition(".")
        if cls:
            owner = getattr(owner, cls)
        raw = inspect.getattr_static(owner, attr)
        static = isinstance(raw, staticmethod)
        fn = raw.__func__ if static else raw
        w = wrapped(fn, qual, stamp)
        setattr(owner, attr, staticmethod(w) if static else w)


def wrapped(fn: Any, name: str, stamp: Any) -> Any:
    """``fn`` with ``stamp("B", name)`` at its entry and ``stamp("E", name)`` at its exit
    (a coroutine's and a generator's exit: when it ends, not when it is made)."""
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def steps(*a: Any, **k: Any) -> Any:
            stamp("B", name)
            try:
                return (yield from fn(*a, **k))
            finally:
                stamp("E", name)

        return steps
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def awaited(*a: Any, **k: Any) -> Any:
            stamp("B", name)
            try:
                return await fn(*a, **k)
            finally:
                stamp("E", name)

        return awaited

    @functools.wraps(fn)
    def called(*a: Any, **k: Any) -> Any:
        stamp("B", name)
        try:
            return fn(*a, **k)
        finally:
            stamp("E", name)

    return called


def timeline(out_dir: str, back: int = 2) -> str:
    """One update of the merged stamps (``back``: 1 the last, 2 the one before), in
    microseconds from trainer rank 0's push; processes named P0, P1, ... as they appear."""
    lines = []
    for path in glob.glob(os.path.join(out_dir, "*.log")):
        with open(path) as f:
            lines += [ln.split() for ln in f if len(ln.split()) == 5]
    lines.sort(key=lambda ln: int(ln[0]))
    pushes = [i for i, ln in enumerate(lines) if ln[3:] == ["B", "ShardedSender.push"]]
    first = lines[pushes[0]][1] if pushes else ""
    starts = [i for i in pushes if lines[i][1] == first]
    if len(starts) <= back:
        return f"too few updates traced ({len(starts)})"
    a, b = starts[-back - 1], starts[-back]
    t0 = int(lines[a][0])
    names: dict[str, str] = {}
    rows = []
    for ln in lines[a:b]:
        p = names.setdefault(ln[1], f"P{len(names)}")
        rows.append(f"{(int(ln[0]) - t0) / 1000:9.1f} us {p} {ln[2][:28]:28} {ln[3]} {ln[4]}")
    return "\n".join(rows)
