"""NIXL's one-sided writes into an engine's memory, against rlferry's shm push (one host, CPU).

An engine process preallocates the parameters of Qwen3-8B's state dict (exact
names and shapes; ``--scale 8`` divides every width: 399 tensors, 0.26 GB bf16),
registers them with a NIXL agent (DRAM) and hands its agent metadata and the
tensors' (address, bytes, device) triples to the trainer over a pipe. The trainer
registers its own state dict, loads the engine's metadata and builds one WRITE
request for all 399 descriptor pairs, once; each update reposts that request with
the version as its notification. An update is timed from the post until the
trainer's request is DONE and the engine has seen the notification (the moment an
engine could serve the new weights). After every update the engine's bytes are
checked against the trainer's and zeroed (untimed), so each check sees that
update's bytes.

Baselines in the same run, same bytes, same process roles:

- one memcpy of the bytes in one process (``ctypes.memmove``, pre-faulted buffers);
- rlferry's shm push, packed (``zero_copy=False``) and zero copy, to a
  ``WeightReceiver`` in an engine process (benchmarks/weights.py's helpers; they
  check the engine's parameters once, after the last push);
- ``process_vm_writev`` of the same (address, bytes) pairs into the NIXL engine: the
  kernel call (cross-memory attach) that UCX's ``cma`` transport makes here, alone.

NIXL offers no blocking wait: completion is known only by polling
``check_xfer_state`` (initiator) and ``get_new_notifs`` (target). This benchmark
polls both with a 100 us sleep between polls; rlferry's product code waits on
sockets and events instead. ``UCX_PROTO_INFO`` is switched on in the trainer
(into a log file) to report which UCX transport did the writes.

Needs NIXL (``pip install nixl-cu12``; it brings its own torch) and rlferry in the
same environment (``pip install -e .``)::

    /tmp/nixlenv/bin/python benchmarks/nixl_eval.py --repeat 10
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib.metadata
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from weights import Engine, Timing, _header, _rlferry, _row, _table, _timing

import _weights_engine as eng

_POLL_S = 100e-6  # the sleep between two polls of NIXL's completion state
_WAIT_S = 60.0  # the bound of every wait for a transfer or a notification


def _nixl() -> Any:
    """NIXL's Python API: the ``nixl_cu12`` wheel's module, or ``nixl``'s."""
    try:
        import nixl_cu12 as nixl
    except ImportError:
        try:
            import nixl._api as nixl  # type: ignore[no-redef]
        except ImportError as e:
            raise SystemExit(
                f"nixl: expected NIXL's Python package, got {e} (pip install nixl-cu12 into the "
                "environment that runs this benchmark)"
            ) from None
    return nixl


def _agent(name: str) -> Any:
    nixl = _nixl()
    return nixl.nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"]))


def _backends() -> dict[str, str]:
    """Every NIXL plugin this install has: the memory kinds of the backend it made here,
    or the error creating it raised (a plugin whose libraries are missing is NOT_FOUND)."""
    nixl = _nixl()
    agent = nixl.nixl_agent("probe", nixl.nixl_agent_config(backends=[]))
    found = {}
    for plugin in agent.get_plugin_list():
        try:
            agent.create_backend(plugin, {})
            found[plugin] = "+".join(
                m.removesuffix("_SEG") for m in agent.get_backend_mem_types(plugin)
            )
        except Exception as e:  # the error is the finding: printed
            found[plugin] = type(e).__name__
    return found


def _poll(done: Any, what: str) -> int:
    """Poll ``done()`` until it is true, ``_WAIT_S`` at most; the number of polls.

    Only NIXL's completion is waited on this way: NIXL exposes no blocking wait and
    no file descriptor to wait on (``getXferStatus`` and ``getNotifs`` only)."""
    deadline = time.monotonic() + _WAIT_S
    polls = 0
    while not done():
        polls += 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"nixl: {what} did not happen within {_WAIT_S:.0f} s")
        time.sleep(_POLL_S)
    return polls


# -- the engine process -------------------------------------------------------------------------


def nixl_engine_main(shapes: eng.Shapes, conn: Connection) -> None:
    """Runs in its own process: preallocated parameters registered with a NIXL agent."""
    params = [torch.zeros(s, dtype=torch.bfloat16) for _, s in shapes]
    agent = _agent("engine")
    t0 = time.perf_counter()
    reg = agent.register_memory(params)
    register_s = time.perf_counter() - t0

    def await_notif(tag: bytes) -> int:
        return _poll(lambda: agent.check_remote_xfer_done("trainer", tag, tag_is_prefix=False),
                     f"the engine's notification {tag!r}")  # fmt: skip

    handlers: dict[str, Any] = {
        "metadata": lambda: (
            agent.get_agent_metadata(),
            [(p.data_ptr(), p.numel() * p.element_size(), 0) for p in params],
            register_s,
        ),
        "await": await_notif,
        "fingerprint": lambda: eng.fingerprint(params),
        "zero": lambda: [p.zero_() for p in params] and None,
    }
    conn.send(("ok", "ready"))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                return
            conn.send(("ok", handlers[cmd](*args)))
    finally:
        agent.deregister_memory(reg)


# -- the trainer's side -------------------------------------------------------------------------


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _cma_write(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
    """``process_vm_writev`` of every (address, bytes) pair into process ``pid``: the
    kernel call UCX's ``cma`` transport makes, with nothing above it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_writev.restype = ctypes.c_ssize_t
    want = sum(n for _, n in local)
    lv = (_Iovec * len(local))(*[_Iovec(a, n) for a, n in local])
    rv = (_Iovec * len(remote))(*[_Iovec(a, n) for a, n in remote])
    done = libc.process_vm_writev(pid, lv, len(local), rv, len(remote), 0)
    if done != want:
        err = ctypes.get_errno()
        raise OSError(err, f"process_vm_writev: expected {want} bytes written, got {done} "
                           f"({os.strerror(err)})")  # fmt: skip


def write_request(
    agent: Any, tensors: list[torch.Tensor], metadata: bytes, descs: Any, mem: str
) -> tuple[str, Any, Any, Any]:
    """The remote agent's name, one prepared WRITE of ``tensors`` (registered by
    ``agent``) into the remote's ``descs`` (memory type ``mem``: DRAM or VRAM), pair by
    pair (each post passes its own notification), and the two prepared lists (to
    release after the request)."""
    import numpy as np

    name = agent.add_remote_agent(metadata)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", tensors)
    remote = agent.prep_xfer_dlist(name, descs, mem)
    idx = np.arange(len(tensors), dtype=np.int32)
    return name, agent.make_prepped_xfer("WRITE", local, idx, remote, idx, b""), local, remote


def run_nixl(shapes: eng.Shapes, state: dict[str, torch.Tensor], repeat: int) -> dict[str, Any]:
    """One WRITE request for every tensor, reposted per update; timing and what was seen."""
    engine = Engine(nixl_engine_main, shapes)
    tensors = list(state.values())
    want = eng.fingerprint(tensors)
    try:
        agent = _agent("trainer")
        t0 = time.perf_counter()
        reg = agent.register_memory(tensors)
        metadata, descs, engine_register_s = engine.call("metadata")
        name, handle, local, remote = write_request(agent, tensors, metadata, descs, "DRAM")
        setup_s = time.perf_counter() - t0
        backend = agent.query_xfer_backend(handle)
        times, posts, polls, immediate = [], [], [], 0
        for v in range(1 + repeat):  # one warm-up update (UCX connects on the first)
            tag = b"v%d" % v
            engine.send("await", tag)
            t0 = time.perf_counter()
            status = agent.transfer(handle, tag)
            posts.append(time.perf_counter() - t0)
            if status == "ERR":
                raise RuntimeError(f"nixl: posting update {v} failed")
            immediate += status == "DONE"
            n = _poll(lambda: agent.check_xfer_state(handle) != "PROC", f"update {v}'s WRITE")
            if agent.check_xfer_state(handle) != "DONE":
                raise RuntimeError(f"nixl: update {v}'s WRITE ended in ERR")
            n_engine = engine.wait()
            times.append(time.perf_counter() - t0)
            polls.append((n, n_engine))
            got = engine.call("fingerprint")
            if got != want:
                raise RuntimeError(f"nixl: after update {v} the engine's parameters differ from "
                                   f"the trainer's (checksum {got}, expected {want})")  # fmt: skip
            engine.call("zero")
        handle.release()
        # the same bytes by the kernel call alone, into the same engine (untimed checks)
        pairs = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
        dests = [(a, n) for a, n, _ in descs]
        cma = []
        pid = engine.proc.pid
        assert pid is not None  # started
        for v in range(1 + repeat):
            t0 = time.perf_counter()
            _cma_write(pid, pairs, dests)
            cma.append(time.perf_counter() - t0)
            if engine.call("fingerprint") != want:
                raise RuntimeError(f"cma: after write {v} the engine's parameters differ")
            engine.call("zero")
        local.release()
        remote.release()
        agent.remove_remote_agent(name)
        agent.deregister_memory(reg)
    finally:
        engine.stop()
    return {
        "timing": Timing(sorted(times[1:]), tuple(times[:1])),
        "cma": Timing(sorted(cma[1:]), tuple(cma[:1])),
        "backend": backend,
        "setup_s": setup_s,
        "engine_register_s": engine_register_s,
        "immediate": immediate,
        "polls": polls[1:],
        "post_p50": sorted(posts[1:])[len(posts[1:]) // 2],
        "checked": len(times),
    }


def _ucx_transports(log_dir: str) -> dict[str, set[str]]:
    """What UCX's protocol selection chose in the trainer (``UCX_PROTO_INFO``'s tables):
    {operation: {transport/device, ...}} for the intra-node endpoint (the engine)."""
    chosen: dict[str, set[str]] = {}
    for path in glob.glob(os.path.join(log_dir, "ucx.*")):
        title, intra, expect_title = "", False, False
        with open(path, errors="replace") as f:
            lines = f.readlines()
        for line in lines:
            cells = [c.strip() for c in re.sub(r"^\[[^]]*\] \[[^]]*\]\s*", "", line).split("|")]
            cells = [c for c in cells[1:-1]] if len(cells) > 2 else []
            if len(cells) == 1:
                if "intra-node" in cells[0] or " self " in f" {cells[0]} ":
                    intra, expect_title = "intra-node" in cells[0], True
                elif expect_title:
                    title, expect_title = cells[0], False
            elif len(cells) == 3 and intra and cells[0] != "Range":
                op = "put" if "ucp_put" in title else "am" if "ucp_am_send" in title else ""
                if op:
                    chosen.setdefault(op, set()).add(cells[2].split()[-1] if cells[2] else "?")
    return chosen


def _memcpy(nbytes: int, repeat: int) -> Timing:
    """One memmove of ``nbytes`` between two pre-faulted buffers, ``repeat`` times."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    return _timing(lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes), repeat)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/nixl_eval.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="qwen3-8b", help="qwen3-8b or qwen3-30b-a3b")
    p.add_argument("--scale", type=int, default=8, help="divide every width (8: 0.26 GB)")
    p.add_argument("--repeat", type=int, default=10)
    a = p.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent on stdout
    command = " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv])
    log_dir = tempfile.mkdtemp(prefix="nixl_eval_")
    shapes = eng.model_shapes(a.model, a.scale)
    state = eng.make_state(shapes, "cpu")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    base = _memcpy(nbytes, a.repeat)
    # rlferry first: NIXL's UCX installs memory hooks in the process that loads it
    engine = Engine(eng.engine_main, shapes, "cpu")
    try:
        packed, pused = _rlferry(engine, state, "shm", None, a.repeat, zero_copy=False)
        direct, used = _rlferry(engine, state, "shm", None, a.repeat)
    finally:
        engine.stop()
    os.environ["UCX_PROTO_INFO"] = "y"
    os.environ["UCX_LOG_FILE"] = os.path.join(log_dir, "ucx.%p")
    nixl = run_nixl(shapes, state, a.repeat)
    ucx = _ucx_transports(log_dir)
    backends = _backends()
    t = nixl["timing"]
    polls = nixl["polls"]
    trainer_polls = sorted(x for x, _ in polls)[len(polls) // 2]
    engine_polls = sorted(y for _, y in polls)[len(polls) // 2]
    rows = [
        _row("memcpy of the same bytes, one process (baseline)", base, nbytes, base),
        _row("rlferry shm, packed (zero_copy=False: pack + load, ping-pong)", packed, nbytes,
             base, f"buckets of {pused >> 20} MiB; checked after the last push"),
        _row("rlferry shm, zero copy (the engine loads from the trainer's tensors)", direct,
             nbytes, base, f"{used >> 20} MiB per load call; checked after the last push"),
        _row(f"NIXL {nixl['backend']} WRITE, one request of {len(state)} descriptors", t, nbytes,
             base, f"put by {'/'.join(sorted(ucx.get('put', {'?'})))}, notification by "
             f"{'/'.join(sorted(ucx.get('am', {'?'})))}; DONE at post {nixl['immediate']}/"
             f"{nixl['checked']} (the post's p50 {nixl['post_p50'] * 1e3:.1f} ms); polls p50 "
             f"{trainer_polls} (trainer), {engine_polls} (engine); warm-up "
             f"update {t.warmup[0] * 1e3:.0f} ms; checked after every update"),
        _row(f"process_vm_writev of the same {len(state)} pairs (CMA, no NIXL)", nixl["cma"],
             nbytes, base, "the kernel call alone, one call; checked after every write"),
    ]  # fmt: skip
    nixl_version = importlib.metadata.version("nixl-cu12" if "nixl_cu12" in sys.modules else "nixl")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.node()}, "
          f"{os.cpu_count()} cores; nixl {nixl_version}; `{command}`")  # fmt: skip
    print("NIXL backends: " + ", ".join(f"{k} {v}" for k, v in backends.items()))
    print(_header(a.model, a.scale, state, "cpu", a.repeat).replace("median", "p50"))
    print()
    print(_table(rows, "x memcpy"))
    print()
    print(f"NIXL / rlferry zero copy at the p50s: {t.p50 / direct.p50:.2f}x the time; "
          f"NIXL setup (trainer registration, metadata, prepared lists, request) "
          f"{nixl['setup_s'] * 1e3:.0f} ms, the engine's registration "
          f"{nixl['engine_register_s'] * 1e3:.0f} ms")  # fmt: skip
    if not ucx:
        print(f"(UCX's protocol tables were not found in {log_dir})")


if __name__ == "__main__":
    main()
