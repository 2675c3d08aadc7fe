"""A trainer rank's optimizer step on a GRPO batch; on one GPU, a compiled CUDA graph.

Every step's batch has the same shape: the rank's ``rows`` sequences right-padded to
``width`` tokens (the task's longest prompt and response) under a causal mask alone (no
real token sees the pads after it). A step is the GRPO loss
(:func:`~rlferry.rl.grpo.grpo_objective`), its backward, gradient clipping to norm 1 and
AdamW.

On CUDA with one rank and no adapter the step is a CUDA graph of compiled layers, made
when the step is: each decoder layer is compiled by ``torch.compile`` (one layer's code
serves them all: its chains of elementwise operators fuse into a few kernels, which an
eager layer runs one by one, reading and writing the activations each time), its
attention over rows of at most :data:`~rlferry.rl.trainer._attention.SHORT` tokens as
two products and a fused softmax (``_attention``: SDPA's kernels tile for long rows); then
:data:`WARM_UP` steps on a batch of pads run eagerly on a side stream (they compile the
layers' forward and backward and make AdamW's state and the allocator's, cuBLAS's and
autograd's buffers), the weights and AdamW's state are put back as they were, and one
step is captured: forward, loss, backward, clipping, the fused AdamW step (its step
counts on the device: ``capturable``) and the cast of the weights into the dtype the
engines serve (:attr:`TrainStep.served`, what a push sends). Every step then copies its
batch into the graph's inputs and replays it: one launch for the ~9,000 kernels of a
Qwen3-0.6B step, which eagerly cost ~100 ms of Python and dispatch. FSDP's collectives
(two ranks or more) and an adapter's gradient averaging run eagerly.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rlferry.errors import RequestError

from ..grpo import GrpoBatch, GrpoStats, GrpoTerms, PaddedBatch, grpo_objective
from ._attention import SHORT, use_short_attention

__all__ = ["WARM_UP", "TrainStep"]

WARM_UP = 3
"""Eager steps on a side stream before the capture (PyTorch asks for a few)."""


class TrainStep:
    """``step(batch) -> GrpoStats``: one optimizer step of ``model`` on ``batch`` (``rows``
    sequences of at most ``width`` tokens). ``graphed``: replay the step as a CUDA graph
    (the model and ``optimizer`` on one GPU; ``optimizer`` made ``capturable``);
    ``autocast``: the forward's dtype, or None; ``adapter``: a LoRA adapter whose
    gradients the ranks average after the backward."""

    def __init__(
        self, model: Any, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, *,
        rows: int, width: int, clip: float, autocast: torch.dtype | None, graphed: bool,
        adapter: Any = None,
    ) -> None:  # fmt: skip
        device = next(model.parameters()).device
        if graphed and (device.type != "cuda" or adapter is not None):
            raise RequestError("TrainStep.graphed: a CUDA graph needs a CUDA model and no adapter")
        self.model, self.params, self.optimizer = model, params, optimizer
        self.rows, self.width, self.clip = rows, width, clip
        self.graphed, self.adapter = graphed, adapter
        self._dtype = autocast
        self._device = device
        self._replays = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._values: torch.Tensor | None = None  # the graph's output: the step's figures
        # the graph's inputs (eager steps read them too): fixed addresses and shapes
        self._inputs = (
            torch.zeros((rows, width), dtype=torch.long, device=device),
            torch.zeros((rows, width), dtype=torch.float32, device=device),
            torch.zeros((rows, width), dtype=torch.float32, device=device),
            torch.zeros((rows, 1), dtype=torch.float32, device=device),
            torch.ones((), dtype=torch.float32, device=device),
        )
        # the weights in the forward's dtype, as the engines serve them, at fixed addresses:
        # a graph's step writes them after AdamW's (no cast at push time)
        self._served: list[tuple[str, torch.Tensor]] | None = None
        self._sources: list[torch.Tensor] = []
        if graphed and autocast is not None:
            named = list(model.state_dict().items())
            self._served = [(n, torch.empty_like(t, dtype=autocast)) for n, t in named]
            self._sources = [t.detach() for _, t in named]
        if graphed:
            if width <= SHORT:  # the layers' attention as products the compiler fuses
                use_short_attention(model)
            for layer in model.model.layers:  # the same code: compiled once for all
                layer.compile(dynamic=False)
            self._capture()
            self._serve()  # the weights as they are now (a push may come before a step)

    @property
    def served(self) -> list[tuple[str, torch.Tensor]] | None:
        """The state dict in the forward's dtype, as of the last step (a graph's step
        writes it), or None: a push casts the weights itself."""
        return self._served

    def _serve(self) -> None:
        if self._served is not None:
            torch._foreach_copy_([t for _, t in self._served], self._sources)

    @property
    def replayed(self) -> int:
        """How many steps replayed the CUDA graph."""
        return self._replays

    def __call__(self, batch: GrpoBatch) -> GrpoStats:
        padded = PaddedBatch.of(batch, self.width)
        if len(batch.prompts) != self.rows:
            raise RequestError(
                f"TrainStep: expected {self.rows} sequences (the rank's share of a step), "
                f"got {len(batch.prompts)}"
            )
        if padded.tokens == 0:
            raise RequestError(
                "TrainStep.batch: expected at least one response token, got 0 (every response "
                "is empty)"
            )
        for mine, given in zip(self._inputs, padded.tensors(), strict=True):
            mine.copy_(given, non_blocking=False)
        if self._graph is None:
            values = self._eager()
        else:
            self._graph.replay()
            self._replays += 1
            assert self._values is not None
            values = self._values
        return GrpoTerms(values, padded.tokens).stats()  # the step's one wait for the device

    def _eager(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        values = self._forward_backward()
        self.optimizer.step()
        return values

    def _forward_backward(self) -> torch.Tensor:
        """The loss, its backward and clipping; the step's figures."""
        cast = (
            # no cast cache: a graph's casts are made inside it, each weight once a step
            torch.autocast(self._device.type, dtype=self._dtype, cache_enabled=False)
            if self._dtype is not None
            else contextlib.nullcontext()
        )
        with cast:
            loss, values = grpo_objective(self.model, *self._inputs, clip=self.clip)
        loss.backward()
        if self.adapter is not None:  # FSDP averages the model's gradients; the adapter's here
            self.adapter.average_gradients()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        return values

    def _capture(self) -> None:
        """Warm up, put the weights and AdamW's state back, and capture a step."""
        _, mask, _, advantages, count = self._inputs
        mask[:, -1] = 1.0  # a batch of pads, a response token a row
        advantages.fill_(1.0)
        count.fill_(float(self.rows))
        weights = [p.detach().clone() for p in self.params]
        held = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
                for p, state in self.optimizer.state.items()}  # fmt: skip
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            for _ in range(WARM_UP):
                self._eager()
        torch.cuda.current_stream(self._device).wait_stream(side)
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self.params], weights)
            for p, state in self.optimizer.state.items():
                for k, v in state.items():  # as held, or as a new AdamW's: zeros
                    if not torch.is_tensor(v):
                        continue
                    if p in held:
                        v.copy_(held[p][k])
                    else:
                        v.zero_()
        del weights, held
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self._device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the rank's other threads (its sender's) may use CUDA meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            values = self._forward_backward()
            self.optimizer.step()
            self._serve()
        self._graph, self._values = graph, values
