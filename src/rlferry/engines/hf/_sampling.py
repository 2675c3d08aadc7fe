"""Sampling a token per row: the rows' settings as tensors, the uniforms their generators
draw, and the draw itself (greedy rows take the argmax; sampled rows invert their
distribution's CDF at their uniform, after top-p where asked)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from ._batch import Row

__all__ = ["Sampling", "sample", "sampling", "uniforms"]


class Sampling(NamedTuple):
    """How to sample each row: temperature (1 for greedy rows: their logprobs are of the
    plain softmax), top-p (None when every row keeps all tokens), which rows are greedy
    (None when none or all are), whether all are, and each sampled row's generator."""

    temps: torch.Tensor
    top_p: torch.Tensor | None
    greedy: torch.Tensor | None
    all_greedy: bool
    rngs: list[random.Random | None]


def sampling(rows: Sequence[Row], device: torch.device) -> Sampling:
    """How to sample each of ``rows`` on ``device``."""
    rngs = [r.rng for r in rows]
    sampled = sum(g is not None for g in rngs)
    temps = torch.tensor([[r.temperature or 1.0] for r in rows], dtype=torch.float32)
    top_p = None
    if any(r.top_p < 1.0 for r in rows if r.rng is not None):
        top_p = torch.tensor([[r.top_p] for r in rows], dtype=torch.float32).to(device)
    greedy = None
    if 0 < sampled < len(rows):
        greedy = torch.tensor([g is None for g in rngs], dtype=torch.bool).to(device)
    return Sampling(temps.to(device), top_p, greedy, sampled == 0, rngs)


def uniforms(how: Sampling, device: torch.device) -> torch.Tensor | None:
    """Each sampled row's uniform from its own generator (None when every row is greedy):
    drawn before a step, so that its copy to the device waits for nothing."""
    if how.all_greedy:
        return None
    u = torch.tensor([g.random() if g is not None else 0.0 for g in how.rngs])
    return u.to(device, torch.float32, non_blocking=True)[:, None]


def sample(
    logits: torch.Tensor, how: Sampling, u: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of every row and its log probability under ``softmax(logits / T)``
    (before top-p). Greedy rows take the argmax of the logits; sampled rows invert their
    distribution's CDF at their uniform ``u`` (from :func:`uniforms`)."""
    logits = logits.float()
    if how.all_greedy or u is None:  # log softmax at one token: no (rows, vocab) output
        tokens = logits.argmax(-1)
        return tokens, logits.gather(1, tokens[:, None])[:, 0] - logits.logsumexp(-1)
    logp = torch.log_softmax(logits / how.temps, -1)
    probs = logp.exp()
    last = logits.shape[-1] - 1
    if how.top_p is None:
        cdf = probs.cumsum(-1)
        tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=last)[:, 0]
    else:
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        sp, order = probs.sort(-1, descending=True)
        cdf = torch.where(sp.cumsum(-1) - sp < how.top_p, sp, 0.0).cumsum(-1)
        pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=last)
        tokens = order.gather(1, pick)[:, 0]
    if how.greedy is not None:
        tokens = torch.where(how.greedy, logits.argmax(-1), tokens)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]
