"""What the demo's driver asks of its trainer ranks besides training: each update's push,
and, at the end, the fingerprint of the weights they hold against the engines'."""

from __future__ import annotations

import asyncio
from typing import Any

from rlferry.control import Coordinator

from ._config import DemoConfig
from ._processes import answer

__all__ = ["final_check", "pusher"]


def pusher(ranks: list[Any], version: int, sent: list[list[int]]) -> Any:
    """The push of an update: every trainer rank pushes (its own shards, or its part of
    the gathers that rank 0 pushes) and answers once the engines loaded what it sent;
    the bytes each sent go to ``sent``. A rank that failed fails the update, by name
    (every rank's answer is read first: nothing is left unread)."""

    def push(seconds: float) -> dict[str, Any]:
        for conn in ranks:
            conn.send(("push", version, seconds))
        answers: list[dict[str, Any]] = []
        failed: list[BaseException] = []
        for conn in ranks:
            try:
                answers.append(answer(conn))
            except (RuntimeError, EOFError, OSError) as e:
                failed.append(e)
        if failed:
            raise failed[0]
        sent.append([a["bytes"] for a in answers])
        return {"seconds": max(a["seconds"] for a in answers), "bytes": sent[-1]}

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
