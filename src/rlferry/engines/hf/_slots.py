"""The running batch of an :class:`~rlferry.engines.hf.HFEngine` on a preallocated KV cache.

Every row owns a slot: its own columns of a cache allocated once (layers x slots x KV heads
x ``max_len`` x head dim), from column 0, with no padding. Rows join by a prefill of their
prompts (left padded to a common width), whose keys and values each layer writes straight
into the rows' slots (padding goes to one scratch slot past the others; rows of one prompt,
a GRPO group's samples, share one row of the prefill, whose keys and values are then copied
to their slots); they leave by moving the last row into the slot they free, so the rows
always hold slots ``[0, n)``. A decode step feeds the first ``B`` slots (``B`` the smallest
bucket, a power of two or every slot, that holds the rows): each row writes its new key and
value at its own column (``pos``), sees the columns before it through an additive mask, and
its position id is its length.

A decode step runs on the columns its longest row reaches (a span: see ``_span``), not
the whole cache. On CUDA each (rows bucket, span) decode step is captured as a CUDA graph
when the batch is made (so no step waits for a capture) and replayed; the graphs of a
rows bucket write their logits to one buffer (one per span would cost 78 MB each at 256
rows of Qwen3's vocabulary in bf16). So is each
prefill bucket (rows bucket x width bucket, a power of two from 16 columns, within the
engine's ``max_prefill`` tokens): an eager prefill launched for tens of ms, and a weight
update's pause waited for it. The inputs (ids, positions, masks), the cache and the
weights keep their addresses, so a weight update (copied in place) needs no new capture.
A step launches the graph, then samples on the device (the uniforms of sampled rows are
drawn on the host and copied before the graph runs), and reads the tokens and their log
probabilities back in one copy: one host sync per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._batch import Row, record
from ._model import cache_kw
from ._sampling import Sampling, sample, sampling, uniforms
from ._slot_caches import PrefillCache, SlotCache

__all__ = ["SlotBatch"]


class SlotBatch:
    """The rows being generated, in slots ``[0, len(rows))`` of a cache of ``max_batch``
    slots of ``max_len`` columns; ``graphs``: replay decode steps as CUDA graphs."""

    def __init__(
        self, model: Any, device: torch.device, *, max_batch: int, max_len: int, graphs: bool,
        max_prefill: int = 8192,
    ) -> None:  # fmt: skip
        self.model, self.device = model, device
        self.rows: list[Row] = []
        self.max_len = max_len
        self._kw = cache_kw(model)
        from transformers import DynamicCache

        # The cache's shapes, read from a one-token forward (a model's own head layout).
        with torch.inference_mode():
            probe: Any = DynamicCache(config=model.config)
            out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
                        use_cache=True, **{self._kw: probe})  # fmt: skip
        logits_like = out.logits[0, -1]
        shapes = [(lay.keys.shape, lay.keys.dtype) for lay in probe.layers]
        # slot max_batch: scratch, where a prefill's padding writes (no decode reads it).
        # Layers of one shape and dtype (most models) are views of one tensor, whose slots
        # move and copy in one indexing for every layer's keys and values.
        per = [((max_batch + 1, s[1], max_len, s[3]), d) for s, d in shapes]
        self._kv: torch.Tensor | None = None
        if len(set(per)) == 1:
            self._kv = torch.zeros((2 * len(per), *per[0][0]), dtype=per[0][1], device=device)
            self.k, self.v = list(self._kv[: len(per)]), list(self._kv[len(per) :])
        else:
            self.k = [torch.zeros(shape, dtype=d, device=device) for shape, d in per]
            self.v = [torch.zeros_like(k) for k in self.k]
        self._min = torch.finfo(self.k[0].dtype).min
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=device)  # next column
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=device)  # next input
        self.mask = torch.full((max_batch, 1, 1, max_len), self._min, dtype=self.k[0].dtype,
                               device=device)  # fmt: skip
        self.mask[:, :, :, 0] = 0  # an empty slot sees column 0: no row of only -inf
        self._columns = torch.arange(max_len, device=device)
        # decode steps by (rows bucket, span): the cache over slots [0, B) and columns
        # [0, W), the graph
        self._caches: dict[tuple[int, int], SlotCache] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # prefills by (rows bucket, width bucket): static inputs, the graph, its logits
        self._prefill_in: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._prefill_logits: dict[tuple[int, int], torch.Tensor] = {}
        self._use_graphs = graphs
        # the longest row's columns at the next step: _reach + _steps (steps since start)
        self._reach, self._steps = 1, 0
        self._pool: Any = None
        self._how: Sampling = sampling([], device)
        self.max_batch = max_batch
        rows = sorted({self._bucket(n) for n in range(1, max_batch + 1)})
        # the logits of the decode graphs over slots [0, B), every span's, by B
        self._logits = (
            {b: logits_like.new_empty((b, len(logits_like))) for b in rows} if graphs else {}
        )
        if self._use_graphs:  # every bucket now: a step never waits for a capture
            widths = sorted({self._width(n) for n in range(1, max_len + 1)})
            spans = sorted({self._span(n) for n in range(1, max_len + 1)})
            with torch.inference_mode():
                for b in rows:
                    for w in spans:
                        self._capture((b, w))
                for w in widths:  # as many rows as one prefill takes (one always fits)
                    for b in (b for b in rows if b * w <= max(max_prefill, w)):
                        self._capture_prefill((b, w))

    def _bucket(self, n: int) -> int:
        """The slots a step over ``n`` rows runs on: a power of two, at most every slot."""
        return min(1 << (n - 1).bit_length(), self.max_batch)

    @staticmethod
    def nbytes(model: Any, max_batch: int, max_len: int) -> int:
        """The cache's bytes, from the model's configuration (before anything is allocated)."""
        cfg = model.config.get_text_config()
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        size = next(model.parameters()).element_size()
        return 2 * cfg.num_hidden_layers * (max_batch + 1) * heads * max_len * dim * size

    # -- the two kinds of step -------------------------------------------------------------
    def _width(self, n: int) -> int:
        """The columns a prefill of prompts of at most ``n`` tokens runs on."""
        return min(max(16, 1 << (n - 1).bit_length()), self.max_len)

    def _span(self, n: int) -> int:
        """The columns a decode step whose longest row holds ``n`` runs on: powers of two
        from 16 up to an eighth of ``max_len`` (at least 64), then its multiples (at most
        12 spans). A step reads the keys and values of every column it runs on: over the
        whole cache, rows of 300 tokens in a cache of 2048 columns read 7x what they use.
        On CUDA each span of each rows bucket has its graph."""
        step = max(64, 1 << (max(1, self.max_len // 8) - 1).bit_length())
        if n <= step:
            return min(max(16, 1 << (n - 1).bit_length()), self.max_len)
        return min(-(-n // step) * step, self.max_len)

    shares_prompts = True
    """Rows of one prompt share one prefill row: a prefill's budget counts its prompts."""

    def prefill_tokens(self, rows: int, width: int) -> int:
        """The tokens a prefill of ``rows`` prompts of at most ``width`` tokens runs on
        (its bucket: the engine admits rows to a prefill within ``max_prefill`` of them)."""
        return self._bucket(rows) * self._width(width)

    def prefill(self, rows: Sequence[Row], version: int) -> list[Row]:
        """One forward pass over the distinct prompts of ``rows`` (left padded), whose keys
        and values fill their slots; the rows that ended at their first token.

        Rows of one prompt (a GRPO group's samples) share its pass: the first row's keys
        and values are copied to the others' slots, and each samples its first token from
        the same logits (the demo's 512 rows a step are 64 prompts: one eighth of the
        tokens)."""
        r, first = len(rows), len(self.rows)
        lengths = [len(row.request.prompt_ids) for row in rows]
        leads: dict[tuple[int, ...], int] = {}  # a prompt's first row (its pass's row)
        lead = [leads.setdefault(row.prompt, i) for i, row in enumerate(rows)]
        unique = list(leads.values())
        u = len(unique)
        key = (self._bucket(u), self._width(max(lengths)))
        graph = self._prefill_graphs.get(key)
        b, w = key if graph is not None else (u, max(lengths))  # eager: no padding rows
        ids = torch.zeros((b, w), dtype=torch.long)
        starts = torch.full((b,), w, dtype=torch.long)  # padding rows: no token of their own
        slots = torch.full((b,), self.max_batch, dtype=torch.long)
        for j, i in enumerate(unique):
            starts[j] = w - lengths[i]
            ids[j, w - lengths[i] :] = torch.tensor(rows[i].request.prompt_ids, dtype=torch.long)
            slots[j] = first + i
        if graph is not None:
            for dst, src in zip(self._prefill_in[key], (ids, starts, slots), strict=True):
                dst.copy_(src, non_blocking=True)
            graph.replay()
            logits = self._prefill_logits[key]
        else:  # on the CPU
            logits = self._prefill_step(*(t.to(self.device) for t in (ids, starts, slots)))
        if u < r:
            row_of = {i: j for j, i in enumerate(unique)}
            logits = logits[torch.tensor([row_of[i] for i in lead], device=self.device)]
            shared = [i for i in range(r) if lead[i] != i]
            self._copy_slots(
                torch.tensor([first + i for i in shared], device=self.device),
                torch.tensor([first + lead[i] for i in shared], device=self.device),
                max(lengths),
            )
        else:
            logits = logits[:r]
        at = torch.arange(first, first + r, device=self.device)
        n = torch.tensor(lengths, dtype=torch.long).to(self.device, non_blocking=True)
        self.mask[at] = torch.where(self._columns < n[:, None], 0.0, self._min).to(self.mask.dtype)[
            :, None, None, :
        ]
        self.pos[at] = n
        self.rows.extend(rows)
        self._how = sampling(self.rows, self.device)
        joined = sampling(rows, self.device)
        tokens, logprobs = sample(logits, joined, uniforms(joined, self.device))
        self.ids[at] = tokens
        ended = record(self, tokens, logprobs, version, first)
        self._reached()
        return ended

    def _copy_slots(self, dst: torch.Tensor, src: torch.Tensor, columns: int) -> None:
        """Every layer's keys and values of slots ``src`` into slots ``dst`` (indexes on the
        device), their first ``columns`` columns."""
        if self._kv is not None:  # one indexing for every layer
            self._kv[:, dst, :, :columns] = self._kv[:, src, :, :columns]
            return
        for t in (*self.k, *self.v):
            t[dst, :, :columns] = t[src, :, :columns]

    def _prefill_step(self, ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor
                      ) -> torch.Tensor:  # fmt: skip
        """A prefill (what a graph captures): the last column's logits. Row ``i``'s prompt
        lies in columns ``[starts[i], w)`` of ``ids``; column ``j`` of it goes to column
        ``j - starts[i]`` of slot ``slots[i]``, padding to the scratch slot."""
        w = ids.shape[1]
        j = self._columns[:w]
        col = j[None, :] - starts[:, None]
        real = col >= 0
        slot = torch.where(real, slots[:, None], self.max_batch)
        col_at = torch.where(real, col, j[None, :])
        positions = col.clamp(min=0)
        # a real column sees the real columns up to it; padding sees itself (no empty row)
        seen = (j[None, None, :] <= j[None, :, None]) & real[:, None, :]
        seen |= torch.eye(w, dtype=torch.bool, device=self.device)[None]
        mask = torch.where(seen, 0.0, self._min).to(self.mask.dtype)[:, None]
        out = self.model(
            input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
            logits_to_keep=1, **{self._kw: PrefillCache(self.k, self.v, slot, col_at)},
        )  # fmt: skip
        return out.logits[:, -1, :]

    def decode(self, version: int) -> list[Row]:
        """One forward pass feeding every row its last token; the rows that ended."""
        n = len(self.rows)
        key = self.step_key()
        u = uniforms(self._how, self.device)  # copied before the step: no wait in between
        if self._use_graphs:
            self._graphs[key].replay()
            logits = self._logits[key[0]][:n]
        else:
            logits = self._step(key)[:n]
        tokens, logprobs = sample(logits, self._how, u)
        self.ids[:n] = tokens
        self._steps += 1  # every row is a token longer
        return record(self, tokens, logprobs, version, 0)

    def step_key(self) -> tuple[int, int]:
        """The (rows bucket, columns span) the next decode step runs on: the columns the
        longest row attends over, its new one included."""
        return self._bucket(len(self.rows)), self._span(self._reach + self._steps)

    def _reached(self) -> None:
        """Set ``_reach`` after rows joined or left (a pass over the rows, never per step)."""
        self._reach = (
            max((len(r.request.prompt_ids) + len(r.tokens) for r in self.rows), default=1)
            - self._steps
        )

    def _step(self, key: tuple[int, int]) -> torch.Tensor:
        """The decode step over slots ``[0, b)`` and columns ``[0, w)`` (what a graph
        captures): the logits. A row's new column lies below ``w``; an empty slot's,
        which runs on with the rows, is held there."""
        b, w = key
        pos = self.pos[:b].clamp(max=w - 1)
        mask = self.mask[:b, :, :, :w]
        mask.scatter_(3, pos[:, None, None, None], 0.0)  # each row sees its new column
        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = SlotCache(
                [k[:b, :, :w] for k in self.k], [v[:b, :, :w] for v in self.v], pos
            )
        cache.pos = pos
        out = self.model(
            input_ids=self.ids[:b, None], position_ids=pos[:, None], attention_mask=mask,
            use_cache=True, **{self._kw: cache},
        )  # fmt: skip
        self.pos[:b].add_(1).clamp_(max=self.max_len - 1)  # an empty slot: kept in the cache
        return out.logits[:, -1, :]

    def _capture(self, key: tuple[int, int]) -> None:
        """Capture ``key``'s decode step; the buffers it uses stay where they are for good
        (the warm-up and the capture leave the positions and the mask as they were)."""
        b = key[0]
        saved = (self.pos[:b].clone(), self.mask[:b].clone())
        self._graphs[key], _ = self._graph(lambda: self._logits[b].copy_(self._step(key)))
        self.pos[:b], self.mask[:b] = saved

    def _capture_prefill(self, key: tuple[int, int]) -> None:
        """Capture bucket ``key``'s prefill, on inputs of padding only (its writes go to
        the scratch slot)."""
        b, w = key
        self._prefill_in[key] = (
            torch.zeros((b, w), dtype=torch.long, device=self.device),
            torch.full((b,), w, dtype=torch.long, device=self.device),
            torch.full((b,), self.max_batch, dtype=torch.long, device=self.device),
        )
        self._prefill_graphs[key], self._prefill_logits[key] = self._graph(
            lambda: self._prefill_step(*self._prefill_in[key])
        )

    def _graph(self, step: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """``step`` captured as a CUDA graph (after one warm-up run on a side stream, as
        CUDA graphs need) in the batch's memory pool; the graph and its output. On the
        batch's device, whichever is current (``torch.cuda.graph`` captures on a stream of
        the current device: on another GPU's, the capture of ``cuda:1`` kernels fails)."""
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                step()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = step()
        self._pool = graph.pool()
        return graph, out

    # -- membership ------------------------------------------------------------------------
    def remove(self, rows: Sequence[Row]) -> None:
        """Take ``rows`` out: the last rows move into the slots they free."""
        gone = {id(r) for r in rows}
        if not any(id(r) in gone for r in self.rows):
            return
        keep = [r for r in self.rows if id(r) not in gone]
        n = len(keep)
        holes = [i for i, r in enumerate(self.rows[:n]) if id(r) in gone]
        movers = [i for i in range(n, len(self.rows)) if id(self.rows[i]) not in gone]
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            # a mover's columns up to its length (a slot holds max_len of them)
            reach = max(len(self.rows[m].prompt) + len(self.rows[m].tokens) for m in movers)
            self._copy_slots(dst, src, min(reach, self.max_len))
            for t in (self.mask, self.pos, self.ids):
                t[dst] = t[src]
            for h, m in zip(holes, movers, strict=True):
                self.rows[h] = self.rows[m]
        self.rows = self.rows[:n]
        self._free(n)
        self._how = sampling(self.rows, self.device)
        self._reached()

    def _free(self, start: int) -> None:
        """Slots from ``start`` on are empty: they see column 0 only, at position 0."""
        self.mask[start:] = self._min
        self.mask[start:, :, :, 0] = 0
        self.pos[start:] = 0

    def clear(self) -> None:
        """Drop every row (after a failed step, whatever state it left)."""
        self.rows = []
        self._free(0)
        self._how = sampling([], self.device)
        self._reached()
