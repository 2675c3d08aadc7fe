"""A trainer rank's part of a job checkpoint: what it owns of each trained parameter, its
optimizer's state for them, and its RNG.

Each rank writes its own file (``trainer-R.rlf``) with the local shard of every
parameter it trains (FSDP2: its rows of each DTensor; a single rank or a LoRA adapter:
the tensors whole), the optimizer's state per parameter in the same order, and its RNG
states; a resumed rank reads its own file back into the parameters and the optimizer it
built the same way. A resume needs the same model, the same number of ranks and the
same adapter rank: anything else is refused, naming the file and the parameter.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from rlferry.errors import RequestError
from rlferry.wire.files import read_file, write_file

__all__ = ["load_rank", "rank_file", "save_rank"]


def rank_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"trainer-{rank}.rlf"


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t`` (a DTensor's local shard, or ``t``)."""
    return t.to_local() if hasattr(t, "to_local") else t


def save_rank(
    directory: str | Path, rank: int, params: list[torch.Tensor], optimizer: torch.optim.Optimizer
) -> dict[str, float]:
    """Write this rank's part into ``directory``; returns its bytes and seconds."""
    t0 = time.perf_counter()
    state = []
    for p in params:
        kept = optimizer.state.get(p, {})
        state.append({k: _local(v).detach().cpu() if isinstance(v, torch.Tensor) else v
                      for k, v in kept.items()})  # fmt: skip
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and params and params[0].device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(params[0].device)
    value = {
        "params": [_local(p).detach().cpu() for p in params],
        "optimizer": state,
        "rng": rng,
    }
    nbytes = write_file(rank_file(directory, rank), value)
    return {"bytes": float(nbytes), "seconds": time.perf_counter() - t0}


def load_rank(
    directory: str | Path, rank: int, params: list[torch.Tensor], optimizer: torch.optim.Optimizer
) -> None:
    """Read this rank's part from ``directory`` into ``params`` and ``optimizer``."""
    path = rank_file(directory, rank)
    if not path.exists():
        raise RequestError(
            f"resume: expected {path} (trainer rank {rank}'s part of the checkpoint), got no "
            f"such file (resume with as many trainer ranks as the checkpointed run had)"
        )
    value = read_file(path)
    saved, states = value["params"], value["optimizer"]
    if len(saved) != len(params):
        raise RequestError(
            f"resume: {path} holds {len(saved)} trained tensors, this rank trains "
            f"{len(params)} (resume with the same model, --lora and number of ranks)"
        )
    # a fused or capturable optimizer counts its steps on the device, others on the host
    steps_on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    with torch.no_grad():
        for i, (p, s) in enumerate(zip(params, saved, strict=True)):
            mine = _local(p)
            if tuple(mine.shape) != tuple(s.shape) or mine.dtype != s.dtype:
                raise RequestError(
                    f"resume: {path}: trained tensor {i} expected {list(mine.shape)} "
                    f"{mine.dtype}, got {list(s.shape)} {s.dtype} (resume with the same "
                    f"model, --lora and number of ranks)"
                )
            mine.copy_(s)
            if states[i]:
                optimizer.state[p] = {k: _placed(v, p, steps_on_device)
                                      for k, v in states[i].items()}  # fmt: skip
    torch.set_rng_state(value["rng"]["cpu"])
    if "cuda" in value["rng"] and params and params[0].device.type == "cuda":
        torch.cuda.set_rng_state(value["rng"]["cuda"], params[0].device)


def _placed(saved: Any, p: torch.Tensor, steps_on_device: bool) -> Any:
    """An optimizer's state value as the optimizer keeps it for ``p``: a tensor of ``p``'s
    shape (``exp_avg``) sharded as ``p`` is; a scalar (``step``) where the optimizer
    counts."""
    if not isinstance(saved, torch.Tensor):
        return saved
    if saved.dim() == 0:
        return saved.to(p.device) if steps_on_device else saved
    out = torch.zeros_like(p)
    _local(out).copy_(saved)
    return out
