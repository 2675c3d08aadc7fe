"""NIXL's one-sided WRITE between two GPUs of one host, against NCCL's own send/recv.

The trainer (this process, cuda:0) holds a state dict with Qwen3-8B's names and shapes,
widths divided by ``--scale`` (2: 399 tensors, 4.1 GB bf16; 64: about 4 MB, the fixed
cost of an update), seeded random values; an engine process (spawned, cuda:1) holds
zeros of the same shapes. An update moves every byte from cuda:0 into cuda:1, by:

- NIXL, UCX backend (UCX should pick ``cuda_ipc`` over NVLink): both processes register
  their tensors (VRAM); the engine hands its agent metadata and its tensors' (address,
  bytes, device) over a pipe; the trainer builds one WRITE request of all descriptor
  pairs once and reposts it per update with the update's tag as its notification. The
  setup (agents, registration, metadata exchange, request) is timed apart.
- the baseline, in the same run and processes: NCCL's ``batch_isend_irecv`` of one
  contiguous buffer of all the bytes (packed once, untimed) and, ``--per-tensor``, of
  one P2POp per tensor straight into the engine's tensors, in one batch.

An update's time runs on the trainer's clock from its post until it holds the engine's
reply on the pipe (one message, tens of us), sent once the engine has seen the
notification or its receive is done and its device synchronized; "seen" is the engine's
wall-clock stamp of that moment less the trainer's post. One warm-up update (reported
apart), then ``--repeat`` timed ones per case; the engine's tensors are zeroed (untimed)
before the warm-up and before the last update and checked bit-identical after them.
NIXL offers no blocking wait, only polling of ``check_xfer_state`` (trainer) and of the
notifications (engine): only for that reason this benchmark polls, sleeping ``--poll-us``
between polls (timer slack adds about 50 us to a sleep; 0: back to back). NCCL's side
blocks in ``wait`` and a device synchronize. Every wait is bounded (60 s). The trainer
logs UCX's protocol choices (``UCX_PROTO_INFO``) to report the transport of the writes.

On a host with two GPUs, with NIXL's wheels for torch's CUDA (nixl-cu13 for CUDA 13,
nixl-cu12 for CUDA 12)::

    python3 -m pip install --no-deps --target /tmp/site nixl_cu13-*.whl nixl-*.whl
    PYTHONPATH=/tmp/site:src:benchmarks python3 benchmarks/nixl_gpu.py --scale 2 --repeat 12
    PYTHONPATH=/tmp/site:src:benchmarks python3 benchmarks/nixl_gpu.py --scale 64 --json o.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

import nixl_eval as ne
from weights import Engine, Timing, _free_port, _progress

import _weights_engine as eng
from _common import gbps, table

_TRAINER, _ENGINE = "cuda:0", "cuda:1"
_WAIT_S = ne._WAIT_S  # 60 s: the bound of every wait
_SHORT = {"nccl_flat": "NCCL one buffer", "nccl_per_tensor": "NCCL per tensor"}
_NAMES = {
    "nccl_flat": "NCCL send/recv, one contiguous buffer (baseline)",
    "nccl_per_tensor": "NCCL send/recv, one P2POp per tensor, one batch",
    "nixl_write": "NIXL {backend} WRITE, one request of {n} descriptors, VRAM to VRAM",
}


def _tag(u: int) -> bytes:
    return b"u%05d" % u  # fixed width: no tag is a substring of another


def _nccl_init(port: int, rank: int, device: str) -> None:
    """A NCCL group of the two processes; its watchdog ends the process when an operation
    takes over 60 s (what bounds NCCL's blocking waits)."""
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        device_id=torch.device(device), timeout=datetime.timedelta(seconds=_WAIT_S),
    )  # fmt: skip
    dist.broadcast(torch.zeros(1, device=device), 0)
    torch.cuda.synchronize(device)


def _p2p(op: Any, bufs: list[torch.Tensor], peer: int) -> None:
    import torch.distributed as dist

    for work in dist.batch_isend_irecv([dist.P2POp(op, b, peer) for b in bufs]):
        work.wait()
    torch.cuda.synchronize()


# -- the engine process -------------------------------------------------------------------------


def engine_main(shapes: eng.Shapes, poll_s: float, conn: Connection) -> None:
    """Runs in its own process on cuda:1: zeros of every shape, commands from ``conn``."""
    import torch.distributed as dist

    for k in ("UCX_PROTO_INFO", "UCX_LOG_FILE"):  # UCX's tables of the trainer only
        os.environ.pop(k, None)
    ne._POLL_S = poll_s
    torch.cuda.set_device(_ENGINE)  # current before NIXL's agent: UCX takes it for VRAM
    params = [torch.zeros(s, dtype=torch.bfloat16, device=_ENGINE) for _, s in shapes]
    st: dict[str, Any] = {}

    def bufs(what: str) -> list[torch.Tensor]:
        return params if what == "params" else [st["flat"]]

    def nixl_setup() -> tuple[bytes, list[tuple[int, int, int]], float]:
        t0 = time.perf_counter()
        st["agent"] = agent = ne._agent("engine")
        st["reg"] = agent.register_memory(params)
        descs = [(p.data_ptr(), p.numel() * p.element_size(), p.get_device()) for p in params]
        return agent.get_agent_metadata(), descs, time.perf_counter() - t0

    def nixl_await(tag: bytes) -> float:
        agent = st["agent"]
        ne._poll(lambda: agent.check_remote_xfer_done("trainer", tag, tag_is_prefix=False),
                 f"the engine's notification {tag!r}")  # fmt: skip
        return time.time()

    def nixl_close() -> None:
        st["agent"].deregister_memory(st.pop("reg"))
        del st["agent"]

    def nccl_init(port: int) -> None:
        _nccl_init(port, 1, _ENGINE)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        st["flat"] = torch.empty(nbytes, dtype=torch.uint8, device=_ENGINE)

    def nccl_recv(what: str) -> float:
        _p2p(dist.irecv, bufs(what), 0)
        return time.time()

    def nccl_close() -> None:
        dist.destroy_process_group()
        del st["flat"]
        torch.cuda.empty_cache()

    def zero(what: str) -> None:
        for b in bufs(what):
            b.zero_()
        torch.cuda.synchronize()

    handlers: dict[str, Callable[..., Any]] = {
        "nixl_setup": nixl_setup, "nixl_await": nixl_await, "nixl_close": nixl_close,
        "nccl_init": nccl_init, "nccl_recv": nccl_recv, "nccl_close": nccl_close,
        "zero": zero, "check": lambda what: eng.fingerprint(bufs(what)),
    }  # fmt: skip
    conn.send(("ok", "ready"))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            return
        try:
            conn.send(("ok", handlers[cmd](*args)))
        except (Exception, SystemExit) as e:  # sent to the trainer, which raises it
            conn.send(("error", f"{cmd}: {type(e).__name__}: {e}"))


# -- the trainer's side -------------------------------------------------------------------------


def _run(engine: Engine, what: str, repeat: int, want: int,
         await_cmd: Callable[[int], tuple[Any, ...]],
         post: Callable[[int], None]) -> dict[str, Any]:  # fmt: skip
    """One warm-up and ``repeat`` timed updates: the engine is told what to await, then
    the clock runs from ``post(u)`` until the engine's reply; checked after the first and
    the last update (the engine's ``what`` zeroed before each of them)."""
    times, seen = [], []
    for u in range(1 + repeat):
        checked = u in (0, repeat)
        if checked:
            engine.send("zero", what)
            engine.wait("zeroing")
        engine.send(*await_cmd(u))
        t0, wall = time.perf_counter(), time.time()
        post(u)
        at = engine.wait(f"report of update {u}")
        times.append(time.perf_counter() - t0)
        seen.append(at - wall)
        if checked:
            engine.send("check", what)
            if (got := engine.wait("checksum")) != want:
                raise RuntimeError(f"after update {u} the engine's bytes differ from the "
                                   f"trainer's (checksum {got}, expected {want})")  # fmt: skip
    return {"timing": Timing(sorted(times[1:]), tuple(times[:1])), "seen": sorted(seen[1:])}


def _nccl_case(engine: Engine, what: str, bufs: list[torch.Tensor], repeat: int,
               want: int) -> dict[str, Any]:  # fmt: skip
    import torch.distributed as dist

    return _run(engine, what, repeat, want, lambda u: ("nccl_recv", what),
                lambda u: _p2p(dist.isend, bufs, 1))  # fmt: skip


def _nccl(engine: Engine, tensors: list[torch.Tensor], a: argparse.Namespace, want: int,
          out: dict[str, dict[str, Any]]) -> None:  # fmt: skip
    import torch.distributed as dist

    port = _free_port()
    engine.send("nccl_init", port)
    _nccl_init(port, 0, _TRAINER)
    engine.wait("NCCL group")
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    cases = {"nccl_flat": ("flat", [flat])}
    if a.per_tensor:
        cases["nccl_per_tensor"] = ("params", tensors)
    for name, (what, bufs) in cases.items():
        _progress(name)
        out[name] = _nccl_case(engine, what, bufs, a.repeat, want)
    engine.send("nccl_close")
    dist.destroy_process_group()
    engine.wait("NCCL group's end")


def _nixl(engine: Engine, tensors: list[torch.Tensor], a: argparse.Namespace, want: int,
          out: dict[str, dict[str, Any]]) -> None:  # fmt: skip
    _progress("nixl_write")
    t0 = time.perf_counter()
    agent = ne._agent("trainer")
    reg = agent.register_memory(tensors)
    engine.send("nixl_setup")
    metadata, descs, engine_setup_s = engine.wait("NIXL metadata", 300)
    name, handle, local, remote = ne.write_request(agent, tensors, metadata, descs, "VRAM")
    setup_s = time.perf_counter() - t0

    def post(u: int) -> None:
        if agent.transfer(handle, _tag(u)) == "ERR":
            raise RuntimeError(f"nixl: posting update {u} failed")
        ne._poll(lambda: agent.check_xfer_state(handle) != "PROC", f"update {u}'s WRITE")
        if agent.check_xfer_state(handle) != "DONE":
            raise RuntimeError(f"nixl: update {u}'s WRITE ended in ERR")

    r = _run(engine, "params", a.repeat, want, lambda u: ("nixl_await", _tag(u)), post)
    r.update(backend=agent.query_xfer_backend(handle), setup_ms=setup_s * 1e3,
             engine_setup_ms=engine_setup_s * 1e3)  # fmt: skip
    out["nixl_write"] = r
    handle.release()
    local.release()
    remote.release()
    agent.remove_remote_agent(name)
    agent.deregister_memory(reg)
    engine.send("nixl_close")
    engine.wait("NIXL's deregistration")


def _guarded(fn: Callable[..., None], names: list[str], out: dict[str, Any], *args: Any) -> None:
    """Run a phase; its failure is recorded on its first case without a result, and the
    run goes on (one run on the GPU machine shows as much as it can)."""
    try:
        fn(*args, out)
    except (Exception, SystemExit) as e:  # SystemExit: nixl_eval's message of a failed import
        name = next((n for n in names if n not in out), names[-1])
        out.setdefault(name, {})["error"] = f"{type(e).__name__}: {e}"
        _progress(f"{name} failed: {out[name]['error']}")


def _summary(r: dict[str, Any], nbytes: int) -> dict[str, Any]:
    if "timing" not in r:
        return dict(r)
    t: Timing = r["timing"]
    extra = {k: v for k, v in r.items() if k not in ("timing", "seen")}
    return {
        "p50_ms": t.p50 * 1e3, "p90_ms": t.p90 * 1e3, "max_ms": t.max * 1e3,
        "gbps_p50": gbps(nbytes, t.p50), "warmup_ms": t.warmup[0] * 1e3,
        "seen_p50_ms": r["seen"][len(r["seen"]) // 2] * 1e3,
        "times_ms": [x * 1e3 for x in t.times], **extra,
    }  # fmt: skip


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _nixl_version() -> str:
    found = []
    for dist_name in ("nixl", "nixl-cu13", "nixl-cu12"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{dist_name} {importlib.metadata.version(dist_name)}")
    return ", ".join(found) or "nixl (no package metadata)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/nixl_gpu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="qwen3-8b", help="qwen3-8b or qwen3-30b-a3b")
    p.add_argument("--scale", type=int, default=2, help="divide every width (2: 4.1 GB)")
    p.add_argument("--repeat", type=int, default=12, help="timed updates per case")
    p.add_argument("--per-tensor", action=argparse.BooleanOptionalAction, default=True,
                   help="also NCCL with one P2POp per tensor")  # fmt: skip
    p.add_argument("--poll-us", type=float, default=10.0, help="sleep between NIXL polls")
    p.add_argument("--json", metavar="OUT", help="append one JSON line of every number")
    a = p.parse_args(argv)
    if (gpus := torch.cuda.device_count()) < 2:
        print(f"nixl_gpu: needs 2 CUDA GPUs (trainer on cuda:0, engine on cuda:1), found "
              f"{gpus}", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    if not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12")):
        print("nixl_gpu: NIXL's Python package is not importable: pip install nixl-cu13 nixl "
              "(torch built for CUDA 13) or nixl-cu12 (CUDA 12)", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    command = " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv])
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent on stdout
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    log_dir = tempfile.mkdtemp(prefix="nixl_gpu_")
    os.environ["UCX_PROTO_INFO"] = "y"  # before UCX loads; the engine drops both
    os.environ["UCX_LOG_FILE"] = os.path.join(log_dir, "ucx.%p")
    ne._POLL_S = a.poll_us * 1e-6
    torch.cuda.set_device(_TRAINER)
    shapes = eng.model_shapes(a.model, a.scale)
    tensors = list(eng.make_state(shapes, _TRAINER).values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    want = eng.fingerprint(tensors)
    out: dict[str, dict[str, Any]] = {}
    _progress(f"engine process on {_ENGINE}")
    engine = Engine(engine_main, shapes, ne._POLL_S, start_s=300, wait_s=_WAIT_S)
    try:
        nccl = ["nccl_flat", "nccl_per_tensor"][: 1 + a.per_tensor]
        _guarded(_nccl, nccl, out, engine, tensors, a, want)
        _guarded(_nixl, ["nixl_write"], out, engine, tensors, a, want)
    finally:
        engine.stop()
    ucx = {k: sorted(v) for k, v in ne._ucx_transports(log_dir).items()}

    rows: list[list[str]] = []
    nixl = out.get("nixl_write", {})
    for key, r in out.items():
        name = _NAMES[key].format(backend=r.get("backend", "UCX"), n=len(tensors))
        if "timing" not in r:
            rows.append([name, "-", "-", "-", "-", f"failed: {r.get('error')}"])
            continue
        t, seen = r["timing"], r["seen"][len(r["seen"]) // 2]
        note = (f"warm-up {_ms(t.warmup[0] * 1e3)} ms; seen by the engine p50 {_ms(seen * 1e3)}"
                " ms; checked after the warm-up and the last update")  # fmt: skip
        if key == "nixl_write":
            note += (f"; put by {'/'.join(ucx.get('put', ['?']))}, notification by "
                     f"{'/'.join(ucx.get('am', ['?']))}; request built once")  # fmt: skip
        if "error" in r:  # after the timed updates (NIXL's teardown)
            note += f"; then failed: {r['error']}"
        ms = [_ms(x * 1e3) for x in (t.p50, t.p90, t.max)]
        rows.append([name, *ms, f"{gbps(nbytes, t.p50):.1f}", note])
    ratios = {k: nixl["timing"].p50 / out[k]["timing"].p50 for k in ("nccl_flat", "nccl_per_tensor")
              if "timing" in nixl and "timing" in out.get(k, {})}  # fmt: skip
    names = [torch.cuda.get_device_name(i) for i in (0, 1)]
    peer = torch.cuda.can_device_access_peer(0, 1)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.node()}; cuda:0 "
          f"{names[0]} -> cuda:1 {names[1]} (peer access: {peer}); torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}); {_nixl_version()}; `{command}`")  # fmt: skip
    print(f"{a.model}{f' / {a.scale}' if a.scale > 1 else ''}: {len(tensors)} tensors, "
          f"{nbytes / 1e9:.3f} GB bf16; p50 of {a.repeat} updates after 1 warm-up; an update: "
          f"the trainer's post until it holds the engine's reply; NIXL polls sleep "
          f"{a.poll_us:g} us")  # fmt: skip
    print()
    print(table(rows, ("case", "p50 ms", "p90 ms", "max ms", "GB/s at p50", "notes")))
    print()
    if ratios:
        print("NIXL / NCCL at the p50s: " + ", ".join(f"{v:.2f}x the time of {_SHORT[k]}"
                                                      for k, v in ratios.items()))  # fmt: skip
    if "setup_ms" in nixl:
        print(f"NIXL setup (trainer's agent, registration, the engine's agent and "
              f"registration, metadata exchange, prepared lists, request): "
              f"{nixl['setup_ms']:.0f} ms, of which the engine's {nixl['engine_setup_ms']:.0f}"
              " ms")  # fmt: skip
    print(f"UCX's log (protocol tables, UCX errors): {log_dir}" + ("" if ucx else " (no tables)"))
    if a.json:
        record = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": command,
            "host": platform.node(), "gpus": names, "peer_access": peer,
            "torch": torch.__version__, "cuda": torch.version.cuda, "nixl": _nixl_version(),
            "model": a.model, "scale": a.scale, "tensors": len(tensors), "bytes": nbytes,
            "repeat": a.repeat, "poll_us": a.poll_us, "ucx_transports": ucx,
            "ucx_log_dir": log_dir, "nixl_over_nccl_p50": ratios,
            "cases": {k: _summary(r, nbytes) for k, r in out.items()},
        }  # fmt: skip
        with open(a.json, "a") as f:
            f.write(json.dumps(record) + "\n")
    if not ucx:  # last: creating every plugin may fail in ways that end the process
        print("NIXL backends: " + ", ".join(f"{k} {v}" for k, v in ne._backends().items()))
    if any("error" in r for r in out.values()):
        raise SystemExit(1)  # the table says which case failed and how


if __name__ == "__main__":
    main()
