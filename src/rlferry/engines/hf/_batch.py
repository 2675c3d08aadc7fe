"""The running batch of an :class:`~rlferry.engines.hf.HFEngine`: rows, KV cache, sampling.

Owned by the engine's thread; nothing here locks. One call is one forward pass:
:meth:`Batch.prefill` runs the prompts of new rows on their own (left padded to a
common length) and merges their cache into the running one, :meth:`Batch.decode`
feeds every row its last token. Rows of different lengths share the cache by left
padding: a 2D attention mask marks each row's real columns, and each row's position
ids count only its real tokens, so a row computes what it would alone (up to the
float rounding of a different batch shape). Finished rows leave through
``batch_select_indices``; columns that no row uses any more are trimmed from the left.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rlferry.control import Completion, FinishReason, GenerateRequest

from ._model import cache_kw
from ._sampling import sample, sampling, uniforms

if TYPE_CHECKING:
    from ._slots import SlotBatch

__all__ = ["Batch", "Row", "record"]


class Row:
    """One request: its answer so far, how to sample it, and whom to tell when it ends."""

    __slots__ = (
        "finish",
        "future",
        "logprobs",
        "loop",
        "max_tokens",
        "prompt",
        "request",
        "rng",
        "stop",
        "temperature",
        "tokens",
        "top_p",
        "versions",
    )

    def __init__(
        self, request: GenerateRequest, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]
    ) -> None:
        p = request.params
        self.request = request
        # its prompt, hashable: rows of one prompt share a prefill (see SlotBatch), made
        # here, in the caller's thread, not in the decode thread's admissions and prefills
        self.prompt = tuple(request.prompt_ids)
        self.loop = loop
        self.future = future
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.max_tokens = p.max_tokens
        self.stop = frozenset(p.stop_token_ids)
        self.temperature = float(p.temperature)
        self.top_p = float(p.top_p)
        # A per-request generator: a seeded request draws the same uniforms in any batch.
        self.rng = random.Random(p.seed) if p.temperature > 0 else None
        self.finish: FinishReason | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def completion(self, engine: str, reason: FinishReason) -> Completion:
        return Completion(
            request_id=self.request.request_id, prompt_ids=self.request.prompt_ids,
            token_ids=self.tokens, logprobs=self.logprobs, versions=self.versions,
            finish_reason=reason, engine=engine,
        )  # fmt: skip


class Batch:
    """The rows being generated, their cache, mask, positions and next inputs."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        new_cache: Callable[[], Any],
        logits_kw: str | None,
        sliding: bool,
    ) -> None:
        self.model = model
        self.device = device
        self._new_cache = new_cache
        self._kw = cache_kw(model)
        self._logits_kw = logits_kw  # "logits_to_keep" where the model takes it
        self.rows: list[Row] = []
        self._dtype = next(model.parameters()).dtype
        # Eager and SDPA attention take an additive 4D mask as it is: a decode step of a
        # padded batch then builds its mask in three small kernels, not transformers' few
        # dozen (other attentions, flash say, get the 2D mask).
        # Not for sliding-window layers: their masks are built by transformers.
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        self._additive = impl in ("eager", "sdpa", "rlferry_gqa_sdpa") and not sliding
        self._reset()

    def _reset(self) -> None:
        self.cache: Any = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # cached columns
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)  # of next_ids
        self.next_ids = torch.zeros(0, dtype=torch.long, device=self.device)
        self._padded = False
        self._sampling()

    shares_prompts = False
    """Rows of one prompt each run their own prefill row (see ``SlotBatch``)."""

    @staticmethod
    def prefill_tokens(rows: int, width: int) -> int:
        """The tokens a prefill of ``rows`` prompts of at most ``width`` tokens runs on."""
        return rows * width

    # -- the two kinds of step -------------------------------------------------------------
    def prefill(self, rows: Sequence[Row], version: int) -> list[Row]:
        """One forward pass over the prompts of ``rows``, which then join the batch; the
        rows that ended at their first token."""
        prompts = [r.request.prompt_ids for r in rows]
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(1) - 1).clamp_(min=0)
        cache = self._new_cache()
        kw: dict[str, Any] = {self._logits_kw: 1} if self._logits_kw else {}
        padded = any(len(p) != width for p in prompts)
        out = self.model(
            input_ids=ids, attention_mask=mask if padded else None, position_ids=positions,
            use_cache=True, **kw, **{self._kw: cache},
        )  # fmt: skip
        how = sampling(rows, self.device)
        tokens, logprobs = sample(out.logits[:, -1, :], how, uniforms(how, self.device))
        self._join(rows, cache, mask, positions[:, -1] + 1, tokens)
        return record(self, tokens, logprobs, version, first=len(self.rows) - len(rows))

    def decode(self, version: int) -> list[Row]:
        """One forward pass feeding every row its last token; the rows that ended."""
        n = len(self.rows)
        self.mask = torch.cat([self.mask, self.mask.new_ones((n, 1))], dim=1)
        mask = None
        if self._padded:
            mask = self.mask
            if self._additive:  # the 4D mask the attention takes as it is (no mask building)
                mask = (1 - mask)[:, None, None, :].to(self._dtype) * torch.finfo(self._dtype).min
        out = self.model(
            input_ids=self.next_ids[:, None], attention_mask=mask,
            position_ids=self.positions[:, None], use_cache=True, **{self._kw: self.cache},
        )  # fmt: skip
        self.positions = self.positions + 1  # the cache grew in place
        tokens, logprobs = sample(
            out.logits[:, -1, :], self._params, uniforms(self._params, self.device)
        )
        self.next_ids = tokens
        return record(self, tokens, logprobs, version, first=0)

    # -- membership ------------------------------------------------------------------------
    def _join(
        self,
        rows: Sequence[Row],
        cache: Any,
        mask: torch.Tensor,
        positions: torch.Tensor,
        next_ids: torch.Tensor,
    ) -> None:
        """Put ``rows`` (their prefilled ``cache`` and ``mask``) after the running rows."""
        if not self.rows:
            self.cache, self.mask = cache, mask
        else:
            width = max(self.mask.shape[1], mask.shape[1])
            old, new = width - self.mask.shape[1], width - mask.shape[1]
            for a, b in zip(self.cache.layers, cache.layers, strict=True):
                a.keys = torch.cat([_left_pad(a.keys, old), _left_pad(b.keys, new)])
                a.values = torch.cat([_left_pad(a.values, old), _left_pad(b.values, new)])
            self.mask = torch.cat([F.pad(self.mask, (old, 0)), F.pad(mask, (new, 0))])
        self.positions = torch.cat([self.positions, positions])
        self.next_ids = torch.cat([self.next_ids, next_ids])
        self.rows.extend(rows)
        self._membership()

    def remove(self, rows: Sequence[Row]) -> None:
        """Take ``rows`` out of the batch (finished or aborted)."""
        gone = {id(r) for r in rows}
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._reset()
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.next_ids = self.next_ids.index_select(0, index)
        # Columns no remaining row uses (the left padding of a longer row that left).
        start = int(self.mask.any(0).to(torch.uint8).argmax())
        if start:
            self.mask = self.mask[:, start:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, start:]
                layer.values = layer.values[:, :, start:]
        self._membership()

    def clear(self) -> None:
        """Drop every row and the cache (after a failed step, whatever state it left)."""
        self.rows = []
        self._reset()

    def _membership(self) -> None:
        self._padded = bool((self.mask == 0).any()) if self.rows else False
        self._sampling()

    def _sampling(self) -> None:
        self._params = sampling(self.rows, self.device)


def record(
    batch: Batch | SlotBatch,
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    version: int,
    first: int,
) -> list[Row]:
    """Append each of ``batch``'s rows from ``first`` on its token; take the rows that
    ended (a stop token, or ``max_tokens``) out of the batch and return them."""
    rows = batch.rows[first:]
    ended: list[Row] = []
    # One copy to the host (one device sync): token ids are exact in float64.
    both = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64))).tolist()
    for row, t_, lp in zip(rows, *both, strict=True):
        t = int(t_)
        row.tokens.append(t)
        row.logprobs.append(lp)
        row.versions.append(version)
        if t in row.stop:
            row.finish = "stop"
        elif len(row.tokens) >= row.max_tokens:
            row.finish = "length"
        else:
            continue
        ended.append(row)
    if ended:
        batch.remove(ended)
    return ended


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` (batch, heads, columns, dim) with ``n`` zero columns before its own."""
    return F.pad(t, (0, 0, n, 0)) if n else t
