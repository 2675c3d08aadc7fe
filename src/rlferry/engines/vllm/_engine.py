"""``VLLMEngine``: a vLLM ``AsyncLLM`` driven as an :class:`rlferry.control.Engine`."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

from rlferry.control import (
    Completion,
    EngineClosed,
    EngineError,
    EngineStatistics,
    GenerateRequest,
    PauseMode,
    RequestError,
)

from ..vllm_server import Requests
from ._lora import ADAPTER_ID, ADAPTER_NAME, ADAPTER_PATH, max_lora_rank

__all__ = ["VLLMEngine"]

_MODES = ("keep", "abort", "wait")
_names = itertools.count()
EXTENSION = "rlferry.engines.vllm.WorkerExtension"


class VLLMEngine:
    """A vLLM ``AsyncLLM`` (its engine core in its own process) as an rlferry engine.

    ``model``: a model directory or name (an ``AsyncLLM`` is built with
    ``engine_args``, and with ``weight_transfer_config={"backend": "rlferry"}``,
    ``worker_extension_cls="rlferry.engines.vllm.WorkerExtension"``,
    ``logprobs_mode="processed_logprobs"`` and ``enable_prefix_caching=False`` unless
    given), or an ``AsyncLLM`` made with that backend and extension.

    ``lora`` (a :class:`rlferry.engines.lora.LoraConfig`): vLLM runs with its LoRA support
    (``enable_lora``, ``max_lora_rank`` the smallest of vLLM's at least the rank, one
    adapter); a push of an adapter's tensors (PEFT's names) goes to vLLM's LoRA manager
    from memory, and every request after its commit is served with it (the base alone
    before the first).

    Versions: rlferry's int versions are vLLM's weight-version labels ``str(v)``;
    vLLM's initial label ``"default"`` is ``version``. A completion's per-token versions
    come from vLLM's ``weight_versions`` spans. Log probabilities are vLLM's processed
    ones: ``log_softmax(logits / temperature)`` (temperature 1 for greedy), taken after
    top-p when ``top_p < 1`` (rlferry's protocol says before: they differ then).

    Pause modes are vLLM's (``keep`` leaves the KV cache; ``abort`` and ``wait`` clear
    the prefix cache, so no request reuses keys computed by older weights).
    ``start_weight_update`` starts vLLM's update and leaves its ``update_weights`` call
    in flight, waiting (up to ``update_timeout`` seconds) for the next push the
    receiver commits; ``finish_weight_update(v)`` checks that ``v`` committed and
    labels it. An update that failed after loading part of a push leaves the model
    holding a mix: the engine then stays paused (``resume`` does not resume it,
    ``is_paused()`` is true) until an update commits whole; one that failed before
    loading anything serves its previous version.

    End of life: :meth:`close` (or ``with``; :meth:`aclose` or ``async with`` on the
    event loop it serves) shuts vLLM down; requests in flight fail with
    :class:`EngineError`, every later call with :class:`EngineClosed`.
    """

    def __init__(
        self,
        model: Any,
        *,
        name: str | None = None,
        version: int = 0,
        update_timeout: float = 60.0,
        lora: Any = None,
        **engine_args: Any,
    ) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise RequestError(f"VLLMEngine.name: expected a non-empty str, got {name!r}")
        if type(version) is not int or version < 0:
            raise RequestError(f"VLLMEngine.version: expected an int >= 0, got {version!r}")
        if not isinstance(update_timeout, (int, float)) or not update_timeout > 0:
            raise RequestError(
                f"VLLMEngine.update_timeout: expected a number > 0, got {update_timeout!r}"
            )
        from vllm.v1.engine.async_llm import AsyncLLM

        if isinstance(model, AsyncLLM):
            if engine_args:
                raise RequestError(
                    f"VLLMEngine: engine_args {sorted(engine_args)} apply to a model path "
                    "only, not to an AsyncLLM already made"
                )
            self.llm = model
        else:
            from vllm.engine.arg_utils import AsyncEngineArgs

            if not isinstance(model, (str, os.PathLike)):
                raise TypeError(
                    f"VLLMEngine.model: expected a model path or an AsyncLLM, got "
                    f"{type(model).__name__}"
                )
            args: dict[str, Any] = {
                "weight_transfer_config": {"backend": "rlferry"},
                "worker_extension_cls": EXTENSION,
                "logprobs_mode": "processed_logprobs",
                "enable_prefix_caching": False,
            }
            if lora is not None:  # vLLM's LoRA, one adapter: the one pushed
                args.update(enable_lora=True, max_lora_rank=max_lora_rank(lora.rank), max_loras=1)
            args.update(engine_args)
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=os.fspath(model), **args))
        self.name = name or f"vllm-{os.getpid()}-{next(_names)}"
        self._requests = Requests(self.name, version)  # in flight, counts, vLLM's label
        self.update_timeout = float(update_timeout)
        self._update: asyncio.Task[Any] | None = None
        self._refusing: str | None = None  # why the engine stays paused (a mixed model)
        self._paused = False
        self._closed = False
        self._error: str | None = None
        self._updates = 0
        self._seconds = {"paused": 0.0, "update": 0.0}
        self._paused_since: float | None = None
        self._update_since: float | None = None
        self._lora: Any = None  # the LoRARequest of the adapter pushed, once one came
        self._lora_on = lora is not None

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> Completion:
        """Generate ``request`` with vLLM; its completion once it ends (a stop token,
        ``max_tokens``, or an abort: then with the tokens so far, reason ``abort``).

        Raises:
            TypeError, ValueError: a request this engine cannot run (named).
            EngineError: vLLM failed the request, or the engine is closed.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._alive()
        rid, p = request.request_id, request.params
        params = SamplingParams(
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
            stop_token_ids=list(p.stop_token_ids), seed=p.seed, logprobs=0,
            ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip
        final = None
        with self._requests.running(request):
            try:
                prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
                async for out in self.llm.generate(prompt, params, rid, lora_request=self._lora):
                    final = out
            except (ValueError, TypeError) as e:  # vLLM's input checks: the request's fault
                raise RequestError(f"request `{rid}`: vLLM refused it: {e}", self.name) from e
            except Exception as e:
                why = f"request `{rid}` failed: {type(e).__name__}: {e}"
                raise EngineError(self.name, why) from e
        if final is None or not final.outputs:
            raise EngineError(self.name, f"request `{rid}`: vLLM ended it without an output")
        return self._completion(request, final.outputs[0])

    def _completion(self, request: GenerateRequest, out: Any) -> Completion:
        tokens = list(out.token_ids)
        logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, out.logprobs or [], strict=False)]
        spans = [(s.version, s.start, s.end) for s in out.weight_versions or ()]
        return self._requests.completion(request, tokens, logprobs, out.finish_reason, spans)

    async def abort_requests(self, ids: Sequence[str] | None = None) -> int:
        """End these requests (every one with None) now, with their tokens so far (finish
        reason ``abort``); how many were in flight."""
        targets = self._requests.in_flight(ids)
        self._alive()
        if targets:
            await self.llm.abort(targets)
        return len(targets)

    # -- pause ------------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "keep") -> None:
        """vLLM's ``pause_generation(mode)``: returns once the engine is paused."""
        if mode not in _MODES:
            raise RequestError(f"pause: mode: expected 'keep', 'abort' or 'wait', got {mode!r}")
        self._alive()
        await self._call("pause", self.llm.pause_generation(mode=mode, clear_cache=mode != "keep"))
        self._paused = True
        if self._paused_since is None:
            self._paused_since = time.monotonic()

    async def resume(self) -> None:
        """Undo :meth:`pause` (not while the model holds a mix of versions)."""
        self._alive()
        self._paused = False
        await self._settle()
        if self._refusing is not None:
            return
        await self._call("resume", self.llm.resume_generation())
        if self._paused_since is not None:
            self._seconds["paused"] += time.monotonic() - self._paused_since
            self._paused_since = None

    async def is_paused(self) -> bool:
        self._alive()
        return bool(await self._call("is_paused", self.llm.is_paused()))

    # -- weights ----------------------------------------------------------------------------
    async def init_weight_transfer(
        self, group: str, address: str, *, secret: str | None = None, timeout: float = 30.0
    ) -> None:
        """Join the trainer's ``WeightSender`` of ``group`` at ``address`` (every worker of
        vLLM; their receivers are named after this engine)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._alive()
        info: dict[str, Any] = {"group": group, "address": address, "name": self.name,
                                "timeout": timeout}  # fmt: skip
        if secret is not None:
            info["secret"] = secret
        req = WeightTransferInitRequest(init_info=info)
        await self._call("init_weight_transfer", self.llm.init_weight_transfer_engine(req))

    async def start_weight_update(self) -> None:
        """Start vLLM's weight update and its ``update_weights`` call, which waits (up to
        ``update_timeout``) for the next push to commit."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._alive()
        await self._settle()
        if self._update is not None:
            raise EngineError(self.name, "start_weight_update: an update is in progress already")
        await self._call("start_weight_update", self.llm.start_weight_update())
        self._update_since = time.monotonic()
        req = WeightTransferUpdateRequest(
            update_info={"version": None, "timeout": self.update_timeout}
        )
        self._update = asyncio.ensure_future(self.llm.update_weights(req))

    async def finish_weight_update(self, version: int) -> None:
        """Serve ``version`` if the push committed it whole, or if it is the version served
        already and the model is whole (the push never came or was refused before it
        loaded anything: the update ends there); else raise ``EngineError`` (and stay
        paused if the model holds a mix)."""
        if type(version) is not int:
            raise TypeError(f"finish_weight_update: expected an int version, got {version!r}")
        self._alive()
        task, self._update = self._update, None
        if task is None:
            raise EngineError(
                self.name,
                f"finish_weight_update({version}): no update in progress "
                "(call start_weight_update first)",
            )
        try:
            await asyncio.wait_for(task, self.update_timeout + 30.0)
        except Exception as e:
            if version == self._requests.version_of() and not (await self._state()).get("mixed"):
                # no push committed and the model is whole: end the update on what it serves
                await self._finish(self._requests.label)
                self._error = f"the update ended on version {version}: {_reason(e)}"
                self._updated()
                return
            why = await self._failed(
                f"finish_weight_update({version}): expected version {version} committed "
                f"whole, got {_reason(e)}"
            )
            raise EngineError(self.name, why) from None
        state = await self._state()
        got = state.get("version")
        if state.get("adapter") and self._lora is None:  # its tokens from here on
            from vllm.lora.request import LoRARequest

            self._lora = LoRARequest(ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH)
        if got != version:
            why = (
                f"finish_weight_update({version}): expected version {version} committed, got "
                f"version {got} (the trainer pushed another version)"
            )
            await self._finish(str(got))
            self._requests.label, self._error = str(got), why
            self._updated()
            raise EngineError(self.name, why)
        await self._finish(str(version))
        self._requests.label, self._refusing = str(version), None
        self._updated()
        if not self._paused:  # a refusing engine that the coordinator resumed already
            await self._call("resume", self.llm.resume_generation())

    async def _finish(self, label: str) -> None:
        """vLLM's ``finish_weight_update(label)``; vLLM then drops every LoRA adapter (its
        base weights changed): the worker adds the pushed one back, from its memory."""
        await self._call("finish_weight_update", self.llm.finish_weight_update(label))
        if self._lora_on:
            await self._call("rlferry_adapter", self.llm.collective_rpc("rlferry_adapter"))

    async def _settle(self) -> None:
        """Take an update that ended without ``finish_weight_update`` (the coordinator
        skips it for an engine whose push failed): note why, and whether the model
        holds a mix."""
        task = self._update
        if task is None or not task.done():
            return
        self._update = None
        if task.cancelled():
            await self._failed("the update was cancelled")
        elif task.exception() is not None:
            await self._failed(f"the update failed: {_reason(task.exception())}")  # type: ignore[arg-type]
        else:
            self._updated()

    async def _failed(self, why: str) -> str:
        """Record a failed update; with a mixed model the engine refuses to serve."""
        if (await self._state()).get("mixed"):
            why += "; the model holds a mix: no request runs until a version commits whole"
            self._refusing = why
        self._error = why
        self._updated()
        return why

    def _updated(self) -> None:
        self._updates += 1
        if self._update_since is not None:
            self._seconds["update"] += time.monotonic() - self._update_since
            self._update_since = None

    async def _state(self) -> dict[str, Any]:
        """The first worker's receiver state (``rlferry_state``)."""
        states = await self._call("rlferry_state", self.llm.collective_rpc("rlferry_state"))
        return dict(states[0]) if states else {}

    async def get_weight_version(self) -> int | None:
        self._alive()
        label = await self._call("get_weight_version", self.llm.get_weight_version())
        return self._requests.version_of(str(label))

    async def statistics(self) -> EngineStatistics:
        """``step_seconds``: seconds with a request in flight (vLLM does not say how long
        it stepped); ``steps``: 0."""
        paused = self._paused or self._refusing is not None
        now = time.monotonic()
        extra = now - self._paused_since if self._paused_since is not None else 0.0
        r = self._requests
        cfg = getattr(self.llm, "model_config", None)  # vLLM's limits, where it says them
        return EngineStatistics(
            name=self.name, version=r.version_of(), paused=paused, running=len(r.inflight),
            waiting=0, finished=r.counts["finished"], aborted=r.counts["aborted"],
            tokens=r.counts["tokens"], steps=0, step_seconds=r.busy_seconds(),
            paused_seconds=self._seconds["paused"] + extra, updates=self._updates,
            update_seconds=self._seconds["update"],
            last_error=self._error, vocab_size=cfg.get_vocab_size() if cfg else None,
            max_model_len=cfg.max_model_len if cfg else None,
        )  # fmt: skip

    # -- life -------------------------------------------------------------------------------
    def _alive(self) -> None:
        if self._closed:
            raise EngineClosed(self.name, "closed (make a new VLLMEngine)")

    async def _call(self, what: str, call: Any) -> Any:
        try:
            return await call
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(self.name, f"{what} failed: {_reason(e)}") from e

    def close(self) -> None:
        """Shut vLLM down (its engine core process included); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.llm.shutdown()
        self.llm = None  # collected now, while the interpreter is whole

    async def aclose(self) -> None:
        """:meth:`close`, then wait (up to 10 s) for vLLM's output task on this event loop
        to end: call it before closing the loop."""
        handler = getattr(self.llm, "output_handler", None) if not self._closed else None
        self.close()
        if handler is not None and not handler.done():
            await asyncio.wait([handler], timeout=10.0)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> VLLMEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
