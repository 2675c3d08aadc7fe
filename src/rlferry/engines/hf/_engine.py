"""``HFEngine``: a Hugging Face ``transformers`` causal LM as an rlferry generation engine.

A dedicated thread runs the decode loop (torch releases the GIL in its kernels); the
protocol's coroutines hand it requests and commands under one ``threading.Condition``
and await futures that the thread resolves through ``loop.call_soon_threadsafe``.
The thread waits on that condition when it has nothing to do: nothing polls.

Gates that stop stepping, each checked at a step boundary (between two forward
passes): ``pause`` (``keep``/``abort``; ``wait`` first drains the running rows),
``start_weight_update`` until ``finish_weight_update``, a push being loaded (from its
first bucket to its commit), and a failed ``finish_weight_update``. ``is_paused()``
is true while any of them holds.

Weights and the load-failure rule: the engine serves only versions committed whole.
The first bucket of a push waits for the step in progress to end and no step runs
until the push commits, so a token never comes from a mix of versions. A push that
fails after some of its buckets were loaded leaves the model holding a mix: the engine
refuses to step (requests wait, ``is_paused()`` is true, ``statistics().last_error``
says why) until a later push commits a whole version. A push that fails before it
loaded anything leaves the model whole: the engine goes on serving its version.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlferry.control import (
    Completion,
    EngineError,
    EngineStatistics,
    GenerateRequest,
    PauseMode,
)
from rlferry.errors import RequestError
from rlferry.weights import ShardedReceiver, WeightReceiver, fingerprint

from ..lora import LoraConfig
from ._batch import Row
from ._bridge import Waiter
from ._cache import choose_batch
from ._lora import ServedAdapter
from ._model import NonFinite, check_finite, check_options, check_request, load_model
from ._receivers import join_senders
from ._thread import STEP_BOUND, DecodeThread

__all__ = ["HFEngine"]

log = logging.getLogger("rlferry.engines")
_names = itertools.count()
_MODES = ("keep", "abort", "wait")


class HFEngine(DecodeThread):
    """A ``transformers`` causal LM generating with its own batched decode loop.

    ``model``: a causal LM object (``PreTrainedModel``) or a local directory (loaded with
    ``AutoModelForCausalLM.from_pretrained``; nothing is downloaded), moved to
    ``device`` and ``dtype`` when given. Requests join the running batch at step
    boundaries, up to ``max_batch`` rows; one prefill takes at most
    ``max_prefill_tokens`` prompt tokens (padded; one request always fits).
    ``max_model_len`` bounds prompt + ``max_tokens`` (default: the model's
    ``max_position_embeddings``). ``version``: the version served before any push.
    ``check_finite``: refuse a pushed bucket that holds NaN or Inf (it costs a read of
    every pushed float tensor). ``lora``: a :class:`rlferry.engines.lora.LoraConfig`: the
    engine serves base + a LoRA adapter of that rank on those modules, applied in its
    forward (exact: the base weights stay as they are); pushes of the adapter's tensors
    (PEFT's names) load into its slots, and a push that does not fit them is refused
    (``LoraMismatch``) before any byte moves. No adapter is served before the first;
    ``adapter.tensors()`` holds the one served.

    Requests made in one event-loop iteration (an ``asyncio.gather`` of a group) are
    prefilled together. Greedy rows equal ``model.generate`` for the same prompt (up
    to the float rounding of another batch shape); a seeded row samples the same
    tokens in any batch.

    With the slot cache (``kv_cache="slots"``, CUDA's default) the engine changes the
    model it serves, computing the same values faster: a one-token step of a
    grouped-query model attends through ``rlferry_gqa_sdpa`` and transformers' RMSNorm
    layers run through ``torch.nn.functional.rms_norm``; on CUDA the rotary embedding of
    Llama-, Mistral- and Qwen-family models rotates q and k together (a change to that
    transformers module for the process, the same values for every model of it).

    On CUDA the engine turns off cuDNN's fused attention for the process (torch's flag is
    process-wide): it builds a plan per new shape, and a decode loop makes new shapes every
    step (measured on an H100: 0.37x ``model.generate`` with it, 1.7-1.8x without). The slot
    cache's one-token steps still call it by name, on the few shapes of their buckets
    and spans (one plan each, made when its graph is captured).

    End of life: :meth:`close` (or ``with``; :meth:`aclose` or ``async with`` on an event
    loop) stops the thread; requests in flight and calls waiting on the engine raise
    :class:`~rlferry.control.EngineClosed`, as does every later call. A step that raises
    fails the requests of the batch (their ``generate`` raises ``EngineError`` naming the
    exception); the engine goes on.

    On the CPU the decode thread has its own OpenMP team: with another thread's team
    alive (the one that built the model, say), libgomp throttles its spin-waits and
    small ops run slower (a 16x256 matmul 1.6x slower on a 2-core VM).
    """

    def __init__(
        self,
        model: Any,
        *,
        name: str | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        max_batch: int = 64,
        max_prefill_tokens: int = 8192,
        max_model_len: int | None = None,
        version: int = 0,
        check_finite: bool = False,
        kv_cache: str | None = None,
        cuda_graphs: bool = True,
        lora: LoraConfig | None = None,
    ) -> None:
        check_options(
            max_batch=max_batch, max_prefill_tokens=max_prefill_tokens, version=version,
            max_model_len=max_model_len, name=name, check_finite=check_finite, kv_cache=kv_cache,
        )  # fmt: skip
        loaded = load_model(model, device, dtype)
        self.model = loaded.model
        self.device: torch.device = loaded.device
        self.vocab_size = loaded.vocab_size
        self._check_finite = check_finite
        # The engine's tensors by their state_dict names (views of the parameters and
        # persistent buffers), and its adapter's by PEFT's: what a push must match and
        # where it is loaded. The adapter's hooks are on before the steps are captured.
        self._tensors: dict[str, torch.Tensor] = dict(self.model.state_dict())
        self.adapter = None if lora is None else ServedAdapter(self.model, lora, self.device)
        if self.adapter is not None:
            self._tensors.update(self.adapter.tensors())
        chosen = choose_batch(
            loaded, kv_cache, max_batch=max_batch, max_model_len=max_model_len,
            max_prefill=max_prefill_tokens, cuda_graphs=cuda_graphs,
        )  # fmt: skip
        self.kv_cache = chosen.kv_cache
        self.max_model_len = chosen.max_model_len
        super().__init__(
            name or f"hf-{os.getpid()}-{next(_names)}", chosen.batch, version=version,
            max_batch=max_batch, max_prefill=max_prefill_tokens,
        )  # fmt: skip
        self._receiver: WeightReceiver | ShardedReceiver | None = None
        self._thread.start()

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> Completion:
        """Generate ``request``; its completion once it ends (stop token, ``max_tokens``,
        or an abort: then with the tokens so far and finish reason ``abort``).

        Raises:
            RequestError: (a ``ValueError``) a request this engine cannot run (a token id
                outside the vocabulary, prompt + ``max_tokens`` beyond ``max_model_len``, a
                request id in flight already); the engine goes on serving the others.
            TypeError: not a ``GenerateRequest``.
            EngineError: the engine closed (``gone``), or the step it was in failed.
        """
        check_request(request, self.vocab_size, self.max_model_len, self.name)
        loop = asyncio.get_running_loop()
        row = Row(request, loop, loop.create_future())
        rid = request.request_id
        with self._cond:
            self._alive()
            if rid in self._ids:
                raise RequestError(
                    f"request `{rid}`: expected a request_id not in flight on engine "
                    f"`{self.name}`, got one that is (request ids are unique per engine)",
                    self.name,
                )
            self._ids[rid] = row
            staged = self._staged.setdefault(loop, [])
            staged.append(row)
            first = len(staged) == 1
        if first:  # the requests made in one loop iteration join in one prefill
            loop.call_soon(self._flush, loop)
        try:
            return await row.future
        except asyncio.CancelledError:
            with self._cond:
                self._aborts.append(({rid}, None))
                self._cond.notify_all()
            raise

    async def abort_requests(self, ids: Sequence[str] | None = None) -> int:
        """End these requests (every one with None) at the next step boundary, with their
        tokens so far (finish reason ``abort``); how many were in flight."""
        if isinstance(ids, str) or not (ids is None or isinstance(ids, Sequence)):
            raise TypeError(
                f"abort_requests: expected a sequence of request ids or None, got "
                f"{type(ids).__name__}"
            )
        waiter = Waiter.here()
        with self._cond:
            self._alive()
            self._aborts.append((None if ids is None else set(ids), waiter))
            self._cond.notify_all()
        count: int = await waiter.future
        return count

    # -- pause --------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "keep") -> None:
        """Return once the engine is paused: at the end of the step in progress for
        ``keep`` (rows and their cache stay) and ``abort`` (every request in flight ends
        with its tokens so far, a queued one with none); for ``wait``, once the running
        rows finished (requests not admitted yet wait for :meth:`resume`). Requests that
        come while paused wait for :meth:`resume`."""
        if mode not in _MODES:
            raise RequestError(f"pause: mode: expected 'keep', 'abort' or 'wait', got {mode!r}")
        waiter = Waiter.here("pause")
        with self._cond:
            self._alive()
            if mode == "wait" and not self._blocked():
                self._draining = True
            else:
                self._paused, self._draining = True, False
            if mode == "abort":
                self._aborts.append((None, None))
            self._waiters.append(waiter)
            self._gate_changed()
        await waiter.future

    async def resume(self) -> None:
        """Undo :meth:`pause` (a weight update or a mix of versions still holds it)."""
        with self._cond:
            self._alive()
            self._paused = self._draining = False
            self._drop_waiters("pause", "a resume() came before the engine paused")
            self._gate_changed()

    async def is_paused(self) -> bool:
        """Whether the engine is not stepping: paused, updating weights, loading a push, or
        refusing after a failed update."""
        with self._cond:
            return self._blocked()

    # -- weights ------------------------------------------------------------------------
    async def init_weight_transfer(
        self, group: str, address: str, *, secret: str | bytes | None = None, timeout: float = 30.0
    ) -> None:
        """Join the trainer's senders of ``group`` at ``address`` (receivers that check
        every plan against the model's tensors before any bucket moves); a later call
        leaves the previous senders.

        ``address`` is asked who sends ``group`` first: a ``WeightSender`` on its own is
        joined by one ``WeightReceiver`` (pushes of any of the model's tensors, in any
        order); the rank 0 of ``ShardedSender`` ranks (each trainer rank sending its own
        shards) describes every rank and the trainer layout, and a ``ShardedReceiver``
        joins every rank, the model's tensors whole (``EngineLayout.whole`` in their
        dtypes): a version is served once every rank's part of it loaded. Point to
        point, ``address`` is rank 0's link to this engine's rank: it learns its rank and
        joins every rank's link to it."""
        with self._cond:
            self._alive()
        recv = await join_senders(
            group, address, tensors=self._tensors, name=self.name, secret=secret,
            device=self.device if self.device.type == "cuda" else None, timeout=timeout,
            load=self._load, on_commit=self._commit, adapter=self.adapter,
        )  # fmt: skip
        with self._cond:
            old, self._receiver = self._receiver, recv
        if old is not None:
            await asyncio.to_thread(old.close)

    async def start_weight_update(self) -> None:
        """Return once no step runs (at the end of the step in progress) until
        :meth:`finish_weight_update`."""
        waiter = Waiter.here("update")
        with self._cond:
            self._alive()
            self._updating = True
            if self._update_since is None:
                self._update_since = time.monotonic()
            self._waiters.append(waiter)
            self._gate_changed()
        await waiter.future

    async def finish_weight_update(self, version: int) -> None:
        """Serve ``version`` if it was committed whole; else raise ``EngineError`` and
        refuse to step until a version commits whole."""
        if type(version) is not int:
            raise TypeError(f"finish_weight_update: expected an int version, got {version!r}")
        with self._cond:
            self._alive()
            self._updating = False
            self._drop_waiters("update", "a finish_weight_update() came before the engine stopped")
            if not self._loading and self._version == version:
                self._refusing = None
                self._update_done()
                self._gate_changed()
                return
            why = (
                f"finish_weight_update({version}): expected version {version} committed "
                f"whole, got version {self._version}"
                + (" and a push loaded in part (the model holds a mix)" if self._loading else "")
                + (f" (the load failed: {self._load_error})" if self._load_error else "")
                + ("" if self._receiver else " (no weight transfer: call init_weight_transfer)")
                + "; no step runs until a version commits whole (push it again)"
            )
            self._refusing = self._error = why
            self._gate_changed()
        raise EngineError(self.name, why)

    async def get_weight_version(self) -> int | None:
        return self._version

    def _commit(self, version: int) -> None:
        if self.adapter is not None:
            self.adapter.committed()
        self._on_commit(version)

    def _load(
        self, loader: Callable[[list[tuple[str, torch.Tensor]]], Any],
        items: list[tuple[str, torch.Tensor]],
    ) -> None:  # fmt: skip
        """The receiver's ``load``: stop stepping at the push's first bucket, then copy.
        Sharded, every trainer rank's bucket comes on a thread of its own: each waits for
        the step in progress to end (the first one to come stopped the next ones)."""
        self._stop_for_load()
        try:
            if self._check_finite:
                check_finite(items)
            loader(items)
        except Exception as e:
            self._load_failed(e, refused=isinstance(e, NonFinite))
            raise
        self._loaded()

    # -- state --------------------------------------------------------------------------
    async def fingerprint(self) -> str:
        """:func:`rlferry.weights.fingerprint` of the weights served: the model's state dict
        (then, with ``lora``, the adapter's tensors as ``LoraLayers.tensors`` orders them),
        equal to the trainer's when the engine holds its weights bit for bit."""
        named = list(self.model.state_dict().items())
        if self.adapter is not None:
            named += self.adapter.tensors().items()
        return await asyncio.to_thread(fingerprint, named)

    async def statistics(self) -> EngineStatistics:
        with self._cond:
            paused = self._seconds["paused"]
            if self._blocked_since is not None:
                paused += time.monotonic() - self._blocked_since
            return EngineStatistics(
                name=self.name, version=self._version, paused=self._blocked(),
                running=len(self._batch.rows),
                waiting=len(self._waiting) + sum(map(len, self._staged.values())),
                finished=self._counts["finished"], aborted=self._counts["aborted"],
                tokens=self._counts["tokens"], steps=self._counts["steps"],
                step_seconds=self._seconds["step"], paused_seconds=paused,
                updates=self._counts["updates"], update_seconds=self._seconds["update"],
                last_error=self._error, vocab_size=self.vocab_size,
                max_model_len=self.max_model_len, loads_between_steps=True,
            )  # fmt: skip

    # -- life ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the decode thread (after the step in progress) and leave the sender; what
        was in flight raises :class:`~rlferry.control.EngineClosed`. A second call does
        nothing. Blocks up to the step in progress: on an event loop, ``await aclose()``."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(STEP_BOUND)
            if self._thread.is_alive():
                log.warning("engine %s: its step did not end within %g s", self.name, STEP_BOUND)
        recv, self._receiver = self._receiver, None
        if recv is not None:
            recv.close()

    async def aclose(self) -> None:
        """:meth:`close` on a worker thread: the event loop serves on while the step in
        progress ends."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> HFEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> HFEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"HFEngine(name={self.name!r}, device={str(self.device)!r}, version={self._version})"
