"""Helpers the benchmarks share: the memcpy baseline, timing, the result table, a tiny model."""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def best_and_median(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Run ``fn`` once to warm up, then ``repeat`` times; (best, median) seconds."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def device_ms(fn: Callable[[], object], repeat: int = 8) -> float:
    """The median ms of ``fn`` to the CUDA device's end, after one warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def memcpy_seconds(nbytes: int, repeat: int = 5) -> float:
    """Median time of one memcpy of ``nbytes`` between two pre-faulted buffers."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)

    def copy() -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)

    return best_and_median(copy, repeat)[1]


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A markdown table, so a run's output pastes into RESULTS.md as it is."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def start_worker(ctx: Any, target: Any, *args: Any) -> tuple[Any, Connection]:
    """A daemon process running ``target(*args, conn)``, and the parent's end of its pipe.
    The parent closes its copy of the worker's end, so a worker that dies ends the pipe and
    :func:`receive` says so at once."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def receive(conn: Connection, what: str, wait: float = 600.0) -> Any:
    """A worker's next message, within ``wait`` seconds; exits naming ``what`` if the worker
    died (its traceback is above) or sent nothing in time."""
    if not conn.poll(wait):
        raise SystemExit(f"no {what} within {wait:g} s")
    try:
        return conn.recv()
    except EOFError:
        raise SystemExit(f"the process that owed {what} died (its error is above)") from None


def tiny(seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()
