"""Weights benchmark: push a model's state dict to an engine process, against baselines.

State dicts with the exact tensor names and shapes of Qwen3-8B (399 tensors,
16.38 GB bf16) and Qwen3-30B-A3B (18,867 tensors, 61.06 GB), random values;
``--scale N`` divides every width (the 8B at 4 is about 1 GB, for the CPU). The
engine is another process with preallocated parameters; every path ends in a
copy into them. Each transport runs its baselines in the same run:

- ``shm`` (CPU): one memcpy of the same bytes; rlferry packed (``zero_copy=False``:
  the sender packs, the engine loads) and zero copy (the engine loads from the
  trainer's tensors, moved into shared memory by the warm-up push).
- ``cuda_ipc`` (one GPU, sender and engine on it): one device-to-device copy of
  the bytes (a flat copy's bandwidth, and a per-tensor copy of the state dict);
  ping-pong IPC buckets with a new handle per bucket (NeMo-RL style); packed
  buckets without overlap (one buffer, handle cached).
- ``broadcast`` (two GPUs, NCCL): one broadcast of 1 GiB (bandwidth); one
  broadcast per tensor (AReaL/slime style); packed 2 GiB buckets without overlap.

Every rlferry row is checked: the engine's parameters must equal the sender's.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import multiprocessing as mp
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from rlferry.weights import WeightSender
from rlferry.weights.copies import GroupedCopy
from rlferry.weights.planning._buckets import default_bucket_bytes

import _weights_engine as eng
from _common import gbps, memcpy_seconds, receive, start_worker, table

_GiB = 1 << 30
_T0 = time.monotonic()


def _progress(what: str) -> None:
    """A line on stderr per phase, so a log shows where the time went."""
    print(f"[{time.monotonic() - _T0:7.1f} s] {what}", file=sys.stderr, flush=True)


class Engine:
    """An engine process, ``target(*args, conn)``, and its command pipe: it answers each
    command with ``("ok", value)`` or ``("error", why)``; every wait is bounded and a dead
    engine is noticed at once (``wait_s``: the bound of a reply, ``start_s`` of the start)."""

    def __init__(
        self, target: Callable[..., None], *args: Any, start_s: float = 600.0,
        wait_s: float = 600.0,
    ) -> None:  # fmt: skip
        self.wait_s = wait_s
        self.proc, self.conn = start_worker(mp.get_context("spawn"), target, *args)
        self.wait("start", start_s)

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def wait(self, what: str = "reply", timeout: float | None = None) -> Any:
        status, value = receive(self.conn, f"engine's {what}", timeout or self.wait_s)
        if status != "ok":
            raise RuntimeError(f"engine: {value}")
        return value

    def call(self, *cmd: Any) -> Any:
        self.send(*cmd)
        return self.wait(f"answer to {cmd[0]}")

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(60)


@dataclasses.dataclass(frozen=True)
class Timing:
    """The seconds of every timed run of one row, sorted, and of the warm-up runs before."""

    times: list[float]
    warmup: tuple[float, ...] = ()

    @property
    def p50(self) -> float:
        return self.times[len(self.times) // 2]

    @property
    def p90(self) -> float:
        return self.times[min(len(self.times) - 1, round(0.9 * (len(self.times) - 1)))]

    @property
    def max(self) -> float:
        return self.times[-1]

    def scaled(self, factor: float) -> Timing:
        return Timing([t * factor for t in self.times])


def _timing(fn: Callable[[], object], repeat: int, warmup: int = 1) -> Timing:
    """``warmup`` runs (plans, handles, groups, allocator), then ``repeat`` timed ones."""
    times = []
    for _ in range(warmup + repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return Timing(sorted(times[warmup:]), tuple(times[:warmup]))


def _rlferry(
    engines: Engine | list[Engine], state: dict[str, torch.Tensor], transport: str,
    bucket: int | None, repeat: int, zero_copy: bool = True, grouped: bool = True,
    nccl_high_priority: bool = True,
) -> tuple[Timing, int]:  # fmt: skip
    """Push ``state`` to every engine ``repeat`` times; (timing, bucket bytes), checked.
    ``grouped``: engines load with ParamLoader and the sender packs with grouped copies;
    else both copy per tensor (``_foreach_copy_``). ``nccl_high_priority``: the sender's
    option (broadcast: its NCCL streams and the engine's)."""
    engines = engines if isinstance(engines, list) else [engines]
    _progress(f"rlferry {transport}" + (f", {len(engines)} engines" if len(engines) > 1 else "")
              + ("" if grouped else ", per-tensor copies"))  # fmt: skip
    sender = WeightSender(group="bench", transport=transport, receivers=len(engines),
                          bucket_bytes=bucket, zero_copy=zero_copy, grouped_pack=grouped,
                          nccl_high_priority=nccl_high_priority)  # fmt: skip
    kind = ("grouped64" if transport == "broadcast" else "grouped") if grouped else "per_tensor"
    for i, engine in enumerate(engines):
        engine.send("rlferry", sender.address, "bench", f"engine{i}", kind)
        assert engine.wait() == "joined"
    version = iter(range(1, 1 << 30))
    # two warm-up pushes: the first sends the plan and forms the group, the second builds
    # the grouped copies of tensors seen again at the same addresses (once per layout)
    push = lambda: sender.push(state.items(), version=next(version))  # noqa: E731
    timing = _timing(push, repeat, warmup=2)
    used = sender.statistics().bucket_bytes
    for engine in engines:
        engine.conn.send("done")
        engine.wait()
    sender.close()
    want = eng.fingerprint(list(state.values()))
    for engine in engines:
        if engine.call("fingerprint") != want:
            raise RuntimeError(
                f"rlferry {transport}: the engine's parameters differ from the sender's"
            )
        engine.call("zero")
    return timing, used


def _row(name: str, t: Timing, nbytes: int, base: Timing, note: str = "") -> list[str]:
    """p50, p90 and max of the row; GB/s and the ratio at the p50s; rlferry's warm-up
    pushes in the notes."""
    ms = [f"{x * 1e3:.1f}" for x in (t.p50, t.p90, t.max)]
    if len(t.warmup) > 1:
        first = ", ".join(f"{x * 1e3:.0f}" for x in t.warmup)
        note = f"{note}; warm-up pushes {first} ms" if note else f"warm-up pushes {first} ms"
    return [name, *ms, f"{gbps(nbytes, t.p50):.1f}", f"{base.p50 / t.p50:.2f}", note]


def _header(
    model: str, scale: int, state: dict[str, torch.Tensor], device: str, repeat: int
) -> str:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    where = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor()
    name = model + (f" / {scale}" if scale > 1 else "")
    return (
        f"{name}: {len(state)} tensors, {nbytes / 1e9:.2f} GB bf16; median of {repeat}; "
        f"{where or platform.machine()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )


# -- shm (CPU) ----------------------------------------------------------------------------------


def run_shm(model: str, scale: int, repeat: int, bucket: int | None) -> str:
    shapes = eng.model_shapes(model, scale)
    state = eng.make_state(shapes, "cpu")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    engine = Engine(eng.engine_main, shapes, "cpu")
    try:
        base = Timing([memcpy_seconds(nbytes, repeat)])
        packed, pused = _rlferry(engine, state, "shm", bucket, repeat, zero_copy=False)
        direct, used = _rlferry(engine, state, "shm", bucket, repeat)
    finally:
        engine.stop()
    rows = [
        _row("memcpy of the same bytes (baseline)", base, nbytes, base),
        _row("rlferry shm, packed (zero_copy=False: pack + load, ping-pong)", packed, nbytes,
             base, f"buckets of {pused >> 20} MiB"),
        _row("rlferry shm, zero copy (the engine loads from the trainer's tensors)", direct,
             nbytes, base, f"{used >> 20} MiB per load call"),
    ]  # fmt: skip
    return _header(model, scale, state, "cpu", repeat) + "\n\n" + _table(rows, "x memcpy")


def _table(rows: list[list[str]], ratio: str) -> str:
    return table(rows, ("path", "p50 ms", "p90 ms", "max ms", "GB/s", ratio, "notes"))


# -- cuda_ipc (one GPU) ----------------------------------------------------------------------


def flat_copy_seconds(nbytes: int, device: str, repeat: int) -> Timing:
    """One device-to-device copy of ``nbytes`` (timed on at most 4 GiB, scaled): the raw
    limit every cuda_ipc row is put beside."""
    n = min(nbytes, 4 * _GiB)
    bufs = [torch.empty(n, dtype=torch.uint8, device=device).random_() for _ in range(2)]

    def once() -> None:
        bufs[1].copy_(bufs[0])
        torch.cuda.synchronize()

    timing = _timing(once, repeat)
    bufs.clear()  # free both before the state dicts are made
    torch.cuda.empty_cache()
    return timing.scaled(nbytes / n)


def _per_tensor_copy_seconds(state: dict[str, torch.Tensor], repeat: int) -> tuple[Timing, Timing]:
    """Copy every tensor once (from another of its shape: no extra memory): one
    ``_foreach_copy_``, and one GroupedCopy (one launch); (foreach, grouped)."""
    groups: dict[tuple[int, ...], list[torch.Tensor]] = collections.defaultdict(list)
    for t in state.values():
        groups[tuple(t.shape)].append(t)
    dst = [t for g in groups.values() for t in g]
    src = [t for g in groups.values() for t in g[1:] + g[:1]]
    grouped = GroupedCopy(dst, src)
    assert grouped.fallback == 0, grouped.why

    def foreach() -> None:
        torch._foreach_copy_(dst, src)
        torch.cuda.synchronize()

    def one_launch() -> None:
        grouped()
        torch.cuda.synchronize()

    return _timing(foreach, repeat), _timing(one_launch, repeat)


def run_cuda_ipc(model: str, scale: int, repeat: int, bucket: int | None, engines: int = 1) -> str:
    shapes = eng.model_shapes(model, scale)
    dev = "cuda:0"
    torch.cuda.set_device(dev)
    nbytes = sum(spec.nbytes for spec in eng.specs_of(shapes))
    _progress(f"{model}: flat copy")
    flat = flat_copy_seconds(nbytes, dev, repeat)
    state = eng.make_state(shapes, dev)
    _progress("engine")
    engine = Engine(eng.engine_main, shapes, dev)
    try:
        largest = max(t.numel() * t.element_size() for t in state.values())
        bucket = bucket or default_bucket_bytes(torch.device(dev), largest)
        direct, used = _rlferry(engine, state, "cuda_ipc", bucket, repeat)
        per, _ = _rlferry(engine, state, "cuda_ipc", bucket, repeat, grouped=False)
        packed, pused = _rlferry(engine, state, "cuda_ipc", bucket, repeat, zero_copy=False)
        more = [Engine(eng.engine_main, shapes, dev) for _ in range(engines - 1)]
        many = _rlferry([engine, *more], state, "cuda_ipc", bucket, repeat) if more else None
        for e in more:
            e.stop()
        base_rows = []
        for name, reopen, buffers in (
            ("ping-pong IPC, new handle per bucket (NeMo-RL style)", True, 2),
            ("packed buckets, no overlap (one buffer, handle cached)", False, 1),
        ):

            def once(reopen: bool = reopen, buffers: int = buffers) -> None:
                engine.send("ipc", bucket, reopen)
                eng.ipc_send(engine.conn, state, bucket, reopen, buffers)
                engine.wait()

            _progress(name)
            base_rows.append((name, _timing(once, repeat)))
        _progress("per-tensor copy")
        per_tensor, grouped = _per_tensor_copy_seconds(state, repeat)
    finally:
        engine.stop()
    rows = [
        _row("device-to-device copy, flat (raw limit)", flat, nbytes, flat,
             "bandwidth of a 4 GiB copy, for these bytes"),
        _row("device-to-device copy, per tensor (_foreach_copy_)", per_tensor, nbytes, flat),
        _row("device-to-device copy, per tensor, one launch (GroupedCopy)", grouped, nbytes,
             flat, "among the state's own tensors: each read and written in one launch "
             "(into other tensors: ~14% less, _copy_tune.py --pairs-only)"),
        *[_row(n + " (baseline)", s, nbytes, flat) for n, s in base_rows],
        _row("rlferry cuda_ipc, packed (zero_copy=False: ping-pong, handles opened once)",
             packed, nbytes, flat, f"buckets of {pused / _GiB:.2f} GiB"),
        _row("rlferry cuda_ipc, zero copy, per-tensor load (_foreach_copy_)", per,
             nbytes, flat, f"{used / _GiB:.2f} GiB per load call"),
        _row("rlferry cuda_ipc, zero copy, grouped load (ParamLoader)", direct,
             nbytes, flat, f"{used / _GiB:.2f} GiB per load call"),
    ]  # fmt: skip
    if many is not None:
        rows.append(_row(f"rlferry cuda_ipc, zero copy, {engines} engines on this GPU",
                         many[0], nbytes, flat, "time of the "
                         "whole push, every engine loading its copy"))  # fmt: skip
    return _header(model, scale, state, dev, repeat) + "\n\n" + _table(rows, "x flat copy")


# -- broadcast (two GPUs, NCCL) ------------------------------------------------------------------


def run_broadcast(
    model: str, scale: int, repeat: int, bucket: int | None, more: list[int] | None = None,
    baselines: bool = True,
) -> str:  # fmt: skip
    """``more``: other bucket sizes for more rlferry rows; ``baselines``: False runs only
    the raw limit and rlferry's rows."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    high = os.environ.get("RLFERRY_BENCH_NCCL_PRIORITY", "high") == "high"  # or normal
    shapes = eng.model_shapes(model, scale)
    dev = "cuda:0"
    torch.cuda.set_device(dev)
    state = eng.make_state(shapes, dev)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    _progress(f"{model}: engine")
    engine = Engine(eng.engine_main, shapes, "cuda:1")
    try:
        port = _free_port()
        engine.send("nccl_init", port)
        eng._nccl_init(port, 0, dev)
        engine.wait()

        def both(cmd: tuple[Any, ...], mine: Callable[[], None]) -> Callable[[], None]:
            def once() -> None:
                engine.send(*cmd)
                mine()
                engine.wait()

            return once

        _progress("raw, per tensor, packed")
        raw = _timing(both(("nccl_raw", _GiB), lambda: eng._nccl_raw(_GiB, 0, dev)), repeat)
        raw_s = raw.scaled(nbytes / _GiB)
        tensors = list(state.values())
        base_rows = []
        if baselines:
            per = _timing(
                both(("nccl_per_tensor",), lambda: eng._nccl_per_tensor(tensors, 0)), repeat
            )
            b2 = 2 * _GiB
            packed = _timing(
                both(("nccl_packed", b2), lambda: eng._nccl_packed(shapes, {}, b2, 0, dev, state)),
                repeat,
            )
            base_rows = [
                _row("one broadcast per tensor (AReaL/slime style, baseline)", per, nbytes, raw_s),
                _row("packed 2 GiB buckets, no overlap (baseline)", packed, nbytes, raw_s),
            ]
        ours = []
        for b in [bucket, *(more or [])]:
            timing, used = _rlferry(engine, state, "broadcast", b, repeat,
                                    nccl_high_priority=high)  # fmt: skip
            ours.append(_row("rlferry broadcast (NCCL, ping-pong, grouped pack and load, "
                             "64 programs)", timing, nbytes, raw_s,
                             f"buckets of {used / _GiB:.2f} GiB"))  # fmt: skip
        timing, used = _rlferry(engine, state, "broadcast", bucket, repeat, grouped=False,
                                nccl_high_priority=high)  # fmt: skip
        ours.insert(0, _row("rlferry broadcast, per-tensor pack and load (_foreach_copy_)",
                            timing, nbytes, raw_s,
                            f"buckets of {used / _GiB:.2f} GiB"))  # fmt: skip
    finally:
        engine.stop()
        import torch.distributed as dist

        if dist.is_initialized():  # the next model's engine is a new process: a new group
            dist.destroy_process_group()
    rows = [
        _row("NCCL broadcast of 1 GiB (raw limit)", raw_s, nbytes, raw_s,
             f"{gbps(_GiB, raw.p50):.0f} GB/s, for these bytes"),
        *base_rows,
        *ours,
    ]  # fmt: skip
    return _header(model, scale, state, dev, repeat) + "\n\n" + _table(rows, "x raw bandwidth")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RUNS = {"shm": run_shm, "cuda_ipc": run_cuda_ipc, "broadcast": run_broadcast}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/weights.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--transport", choices=tuple(RUNS), default="shm")
    p.add_argument(
        "--model",
        default="qwen3-8b",
        help="qwen3-8b, qwen3-30b-a3b, qwen3-0.6b-demo, or several (a,b)",
    )
    p.add_argument("--scale", type=int, default=0, help="divide every width (default: 4 on CPU)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--bucket-mb",
        default="0",
        help="default (0): rlferry's own choice; broadcast: a,b,... for more rows",
    )
    p.add_argument(
        "--no-baselines",
        action="store_true",
        help="broadcast: only the raw limit and rlferry's rows",
    )
    p.add_argument("--engines", type=int, default=1, help="cuda_ipc: also push to N engines")
    a = p.parse_args(argv)
    scale = a.scale or (4 if a.transport == "shm" else 1)
    buckets = [int(b) << 20 or None for b in a.bucket_mb.split(",")]
    bucket, more = buckets[0], [b for b in buckets[1:] if b]
    for model in a.model.split(","):
        if a.transport == "cuda_ipc":
            print(run_cuda_ipc(model, scale, a.repeat, bucket, a.engines), flush=True)
        elif a.transport == "broadcast":
            print(run_broadcast(model, scale, a.repeat, bucket, more, not a.no_baselines),
                  flush=True)  # fmt: skip
        else:
            print(RUNS[a.transport](model, scale, a.repeat, bucket), flush=True)
        print(flush=True)


if __name__ == "__main__":
    main()
