"""What the demo's driver asks of its trainer ranks: a step (held while the update before
it pushes), each update's push, and, at the end, the fingerprint of the weights they hold
against the engines' and the run's closing figures."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from typing import Any

from rlferry.control import Coordinator

from ._config import DemoConfig
from ._processes import REPLY_TIMEOUT, answer
from .checkpoints import kill_point

__all__ = ["ask", "closing_figures", "final_check", "pusher", "train"]

PUSH_MARGIN = 30.0
"""Seconds a rank may take to answer a push beyond the push's own bound (it answers a
failed push too, once its sender gave up)."""


async def ask(conn: Any, rank: int, *cmd: Any, timeout: float = REPLY_TIMEOUT) -> dict[str, Any]:
    """Send trainer rank ``rank`` (at ``conn``) ``cmd`` and await its answer, at most
    ``timeout`` seconds."""
    await _send(conn, cmd)
    return await _answer(conn, rank, timeout, cmd[0])


async def train(
    ranks: list[Any], step: int, update: asyncio.Future[Any] | None, pushing: asyncio.Event
) -> list[dict[str, Any]]:
    """Every rank's step ``step``; their answers. With ``update`` (the update of the step
    before, in flight) the train command follows its push command (``pushing``: set by its
    :func:`pusher`; the push runs on each rank's thread), so the ranks get their batches
    while it pushes; they step once it ended (``("go",)``, sent whatever its outcome: its
    error is this call's)."""
    if update is not None:
        sent = asyncio.ensure_future(pushing.wait())
        await asyncio.wait([sent, update], return_when=asyncio.FIRST_COMPLETED)
        sent.cancel()
    for conn in ranks:
        await _send(conn, ("train", step, update is not None))
    if update is not None:
        try:
            await update
        finally:
            for conn in ranks:
                await _send(conn, ("go",))
    return list(await asyncio.gather(*(
        _answer(conn, rank, REPLY_TIMEOUT, "train") for rank, conn in enumerate(ranks)
    )))  # fmt: skip


async def _send(conn: Any, cmd: tuple[Any, ...]) -> None:
    if isinstance(conn, Connection):  # a pipe: a command is a few bytes
        conn.send(cmd)
    else:  # a Ray actor's end: its call blocks
        await asyncio.to_thread(conn.send, cmd)


async def _answer(conn: Any, rank: int, timeout: float, what: str) -> dict[str, Any]:
    """A rank's answer (``answer``): a pipe read once the event loop sees it readable (no
    thread between the driver and the rank: a thread's hand-offs cost the driver's next
    command time on busy cores); a Ray actor's end read on a thread.

    Raises:
        TimeoutError: no answer within ``timeout`` seconds (the rank is alive: its pipe
            is open).
        EOFError: the rank is gone (its pipe closed), naming it.
        RuntimeError: the rank's own error, as it said it.
    """
    if not isinstance(conn, Connection):
        return await asyncio.to_thread(answer, conn)
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()
    fd = conn.fileno()

    def seen() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(fd, seen)
    try:
        await asyncio.wait_for(readable, timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(
            f"trainer rank {rank} did not answer {what!r} within {timeout:g} s (its process "
            "is alive: see its output for where it stopped)"
        ) from None
    finally:
        loop.remove_reader(fd)
    try:
        return answer(conn)
    except EOFError:
        raise EOFError(
            f"trainer rank {rank} is gone: its pipe closed before it answered {what!r} (its "
            "output says why)"
        ) from None


def pusher(
    ranks: list[Any], version: int, sent: list[list[int]], pushed: list[float] | None = None,
    pushing: asyncio.Event | None = None,
) -> Any:  # fmt: skip
    """The push of an update: every trainer rank pushes (its own shards, or its part of
    the gathers that rank 0 pushes) and answers once the engines loaded what it sent;
    the bytes each sent go to ``sent``, the slowest rank's seconds to ``pushed``;
    ``pushing`` is set once every rank was told to push. A rank that failed fails the
    update, by name (every rank's answer is read first: nothing is left unread)."""

    if pushed is None:
        pushed = []

    async def push(seconds: float) -> dict[str, Any]:
        for conn in ranks:
            await _send(conn, ("push", version, seconds))
        if pushing is not None:
            pushing.set()
        kill_point("push", version)
        answers: list[dict[str, Any]] = []
        failed: list[BaseException] = []
        for rank, conn in enumerate(ranks):
            try:
                answers.append(await _answer(conn, rank, seconds + PUSH_MARGIN, "push"))
            except (RuntimeError, EOFError, OSError) as e:  # OSError: TimeoutError too
                failed.append(e)
        if failed:
            raise failed[0]
        sent.append([a["bytes"] for a in answers])
        pushed.append(max(a["seconds"] for a in answers))
        return {"seconds": pushed[-1], "bytes": sent[-1]}

    return push


async def final_check(
    engines: list[Any], coord: Coordinator, ranks: list[Any], config: DemoConfig
) -> dict[str, Any]:
    """The engines serve the trainer's last version, bit for bit (with weight sync; vLLM
    fuses and repacks what it loads, so for vLLM engines: the version only)."""
    versions = [await e.get_weight_version() for e in engines]
    out: dict[str, Any] = {"engine_versions": versions, "trainer_version": coord.version}
    if not config.sync:
        return out
    if config.engine == "vllm":
        if any(v != coord.version for v in versions):
            raise RuntimeError(
                f"the engines serve versions {versions}, the trainer is at {coord.version}"
            )
        return out
    for conn in ranks:
        conn.send(("fingerprint",))
    answers = await asyncio.gather(*(asyncio.to_thread(answer, conn) for conn in ranks))
    trainer = answers[0]["fingerprint"]
    digests = [await e.fingerprint() for e in engines]
    if any(v != coord.version for v in versions) or any(d != trainer for d in digests):
        raise RuntimeError(
            f"the engines serve versions {versions} with weights {digests}, the trainer is "
            f"at {coord.version} with {trainer}"
        )
    out["weights_fingerprint"] = trainer
    return out


async def closing_figures(
    engines: list[Any], ends: list[Any], coord: Coordinator, ranks: list[Any],
    config: DemoConfig, *, steps: int, sent: list[list[int]],
    written: list[tuple[float, int]], gpus: Any, pushed: list[float],
) -> dict[str, Any]:  # fmt: skip
    """The run's figures measured once, at its end (``steps`` run in this process):
    :func:`final_check`'s of ``engines`` (those that serve the last version), the bytes
    each rank pushed, the checkpoints' cost, the engines' forward passes (``ends``: their
    statistics), the GPUs' busy share, where an update's time went."""
    out = await final_check(engines, coord, ranks, config)
    if written:
        out["checkpoint: write seconds (mean)"] = sum(w[0] for w in written) / len(written)
        out["checkpoint: MB"] = written[-1][1] / 1e6
    if sent:  # what each rank sends per update: its own shards, or rank 0 all
        out["weights_bytes_per_rank"] = sent[-1]
        if config.lora:
            out["LoRA: bytes pushed per update"] = sum(sent[-1])
    forwards = sum(e.steps for e in ends)
    if forwards:  # engines that count their forward passes (HFEngine)
        out["engine: forward passes per step"] = forwards / len(ends) / steps
        out["engine: ms per forward pass"] = 1e3 * sum(e.step_seconds for e in ends) / forwards
    if gpus is not None:
        share = gpus.percent()
        if share is not None:
            out["GPU busy, % of the run (NVML)"] = share
        else:
            out["gpu_busy_why"] = gpus.why
    out.update(_step_figures(ranks, sum(sent[-1]) if sent else 0, pushed))
    stats = coord.statistics()
    if stats.updates:  # where an update's time goes, ms per update
        n = stats.updates / 1e3
        rest = stats.update_seconds - stats.pause_seconds - stats.push_seconds
        out["update: pause (ms)"] = stats.pause_seconds / n
        out["update: push (ms)"] = stats.push_seconds / n
        out["update: commit and resume (ms)"] = rest / n
    return out


def _step_figures(ranks: list[Any], nbytes: int, pushed: list[float]) -> dict[str, Any]:
    """Rank 0's training step beside its roofline estimate (the median step after the
    first: the allocator's and cuBLAS's first calls of an eager step), and the trainer's
    push (median) beside a device copy of the bytes it sent at the measured bandwidth."""
    for conn in ranks:
        conn.send(("figures",))
    answers = [answer(conn) for conn in ranks]  # every rank's, read
    figures = answers[0]
    times = sorted(figures["step_seconds"][1:] or figures["step_seconds"])
    if not times:
        return {}
    roof = figures["roofline"]
    peaks = roof["peaks"]
    least = roof["flops"] / peaks["flops"] + roof["bytes"] / peaks["bandwidth"]
    p50 = times[len(times) // 2]
    out = {
        "train: step, p50 (ms)": 1e3 * p50,
        "train: roofline estimate (ms)": 1e3 * least,
        "train: step / roofline": p50 / least,
        "train: TFLOP a step": roof["flops"] / 1e12,
        "train: GB moved a step": roof["bytes"] / 1e9,
        f"train: measured peak, {peaks['dtype']} (TFLOP/s)": peaks["flops"] / 1e12,
        "train: measured bandwidth (GB/s)": peaks["bandwidth"] / 1e9,
        "train: steps replayed as a CUDA graph": figures["replayed"],
    }
    if pushed and nbytes:
        out["update: the trainer's push, p50 (ms)"] = 1e3 * sorted(pushed)[len(pushed) // 2]
        out["update: a device copy of its bytes (ms)"] = 1e3 * nbytes / peaks["bandwidth"]
    return out
