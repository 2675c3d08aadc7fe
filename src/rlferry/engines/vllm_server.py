"""``VLLMServerEngine``: a running vLLM server (``vllm serve``), by URL, as an
:class:`rlferry.control.Engine`. Needs only aiohttp here (vLLM runs on the server, with
rlferry installed there for its weight-transfer backend).

Also what both vLLM adapters share (``rlferry.engines.vllm.VLLMEngine`` imports it: no
vLLM import here): vLLM's weight-version labels as rlferry versions, a finished vLLM
output as a :class:`rlferry.control.Completion`, the requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from rlferry.control import (
    Completion,
    EngineError,
    EngineStatistics,
    GenerateRequest,
    PauseMode,
    RequestError,
)
from rlferry.wire.lowlevel import AsyncResource

from ._http import JsonClient

__all__ = ["Requests", "VLLMServerEngine", "completion", "version_of"]


_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def version_of(label: str, initial: int) -> int:
    """rlferry's version of a vLLM label: ``"default"`` (the weights vLLM started with) is
    ``initial``, ``"7"`` is 7, a label someone else set is -1 (not an rlferry version)."""
    if label == "default":
        return initial
    try:
        return int(label)
    except ValueError:
        return -1


def completion(
    engine: str, request: GenerateRequest, tokens: Sequence[int], logprobs: Sequence[float],
    finish_reason: object, spans: Iterable[tuple[str, int, int]], served: str, initial: int,
) -> Completion:  # fmt: skip
    """The completion of ``request``: each token's version from vLLM's ``weight_versions``
    ``spans`` (label, start, end), the label ``served`` where no span covers it.

    Raises:
        EngineError: a finish reason rlferry does not know, or not one log probability
            per token.
    """
    rid = request.request_id
    reason = _REASONS.get(str(finish_reason))
    if reason is None:
        raise EngineError(engine, f"request `{rid}`: vLLM finished it with {finish_reason!r}")
    if len(logprobs) != len(tokens):
        raise EngineError(
            engine,
            f"request `{rid}`: expected a log probability per token ({len(tokens)}), got "
            f"{len(logprobs)}",
        )
    versions = [version_of(served, initial)] * len(tokens)
    for label, start, end in spans:
        v = version_of(label, initial)
        for i in range(max(0, start), min(len(tokens), end)):
            versions[i] = v
    return Completion(
        request_id=rid, prompt_ids=list(request.prompt_ids), token_ids=[int(t) for t in tokens],
        logprobs=[float(x) for x in logprobs], versions=versions,
        finish_reason=reason,  # type: ignore[arg-type]
        engine=engine,
    )  # fmt: skip


class Requests:
    """A vLLM adapter's requests: those in flight (ids unique among them), the seconds
    with any in flight, the completions made, and vLLM's label of the weights served
    (``"default"`` reads as ``initial``)."""

    def __init__(self, engine: str, initial: int) -> None:
        self.engine = engine
        self.initial = initial
        self.label = "default"
        self.inflight: set[str] = set()
        self.counts = {"finished": 0, "aborted": 0, "tokens": 0}
        self._busy = 0.0  # seconds with a request in flight, before _since
        self._since: float | None = None  # a request in flight since then

    @contextlib.contextmanager
    def running(self, request: GenerateRequest) -> Iterator[None]:
        """Hold ``request`` in flight (a ``GenerateRequest`` whose id is not in flight)."""
        if not isinstance(request, GenerateRequest):
            raise TypeError(f"generate: expected a GenerateRequest, got {type(request).__name__}")
        rid = request.request_id
        if rid in self.inflight:
            raise RequestError(
                f"request `{rid}`: expected a request_id not in flight on engine "
                f"`{self.engine}`, got one that is (request ids are unique per engine)",
                self.engine,
            )
        if not self.inflight:
            self._since = time.monotonic()
        self.inflight.add(rid)
        try:
            yield
        finally:
            self.inflight.discard(rid)
            if not self.inflight and self._since is not None:
                self._busy += time.monotonic() - self._since
                self._since = None

    def completion(
        self, request: GenerateRequest, tokens: Sequence[int], logprobs: Sequence[float],
        finish_reason: object, spans: Iterable[tuple[str, int, int]],
    ) -> Completion:  # fmt: skip
        """:func:`completion`, counted."""
        done = completion(self.engine, request, tokens, logprobs, finish_reason, spans,
                          self.label, self.initial)  # fmt: skip
        self.counts["aborted" if done.finish_reason == "abort" else "finished"] += 1
        self.counts["tokens"] += len(tokens)
        return done

    def version_of(self, label: str | None = None) -> int:
        """rlferry's version of a vLLM label (of the weights served for None)."""
        return version_of(self.label if label is None else label, self.initial)

    def in_flight(self, ids: Sequence[str] | None) -> list[str]:
        """The ids of ``ids`` in flight (every one in flight for None)."""
        if isinstance(ids, str) or not (ids is None or isinstance(ids, Sequence)):
            raise TypeError(
                f"abort_requests: expected a sequence of request ids or None, got "
                f"{type(ids).__name__}"
            )
        return list(self.inflight) if ids is None else [i for i in ids if i in self.inflight]

    def busy_seconds(self) -> float:
        now = time.monotonic()
        return self._busy + (now - self._since if self._since is not None else 0.0)


_MODES = ("keep", "abort", "wait")
_PREFIX = "generate-tokens-"  # vLLM's id of a /inference/v1/generate request: prefix + ours
_names = itertools.count()


class VLLMServerEngine(AsyncResource):
    """A vLLM server started with the RL routes and the rlferry backend::

        VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --enable-scale-out --skip-tokenizer-init \\
            --logprobs-mode processed_logprobs \\
            --weight-transfer-config '{"backend": "rlferry"}' \\
            --worker-extension-cls rlferry.engines.vllm.WorkerExtension

    driven as an rlferry engine: ``generate`` is vLLM's token-in, token-out route
    (``/inference/v1/generate``: token ids, log probabilities and ``weight_versions``
    spans, so every token's version); ``pause`` / ``resume`` / ``is_paused`` /
    ``abort_requests`` are its RL routes; weights go through its
    ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights`` and
    ``/finish_weight_update`` to the ``rlferry`` backend in its workers, which joins the
    trainer's ``WeightSender``. ``token``: the server's ``--api-key``. Versions are
    vLLM's labels ``str(v)``; its initial ``"default"`` is ``version``.

    ``start_weight_update`` leaves ``/update_weights`` in flight (up to
    ``update_timeout`` seconds) until the next push commits; ``finish_weight_update(v)``
    waits for it, checks the workers' receivers hold ``v`` and labels it. A push that
    failed after loading part of the weights leaves the engine paused (``resume`` keeps
    it so) until an update commits whole.

    End of life: :meth:`aclose` (or ``async with``) closes its HTTP client (the server
    keeps running); later calls raise :class:`~rlferry.control.EngineClosed`.
    """

    def __init__(
        self,
        url: str,
        *,
        name: str | None = None,
        token: str | None = None,
        version: int = 0,
        update_timeout: float = 60.0,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RequestError(f"VLLMServerEngine.url: expected http://HOST:PORT, got {url!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise RequestError(f"VLLMServerEngine.name: expected a non-empty str, got {name!r}")
        if type(version) is not int or version < 0:
            raise RequestError(f"VLLMServerEngine.version: expected an int >= 0, got {version!r}")
        if not isinstance(update_timeout, (int, float)) or not update_timeout > 0:
            raise RequestError(
                f"VLLMServerEngine.update_timeout: expected a number > 0, got {update_timeout!r}"
            )
        self.url = url.rstrip("/")
        self.name = name or f"vllm-server-{next(_names)}"
        self.update_timeout = float(update_timeout)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = JsonClient(self.name, self.url, headers)
        self._requests = Requests(self.name, version)  # in flight, counts, vLLM's label
        self._update: asyncio.Task[Any] | None = None
        self._refusing: str | None = None
        self._paused = False
        self._error: str | None = None
        self._updates = 0
        self._update_seconds = 0.0

    # -- HTTP -------------------------------------------------------------------------------
    async def _call(
        self, method: str, path: str, body: Any = None, *, timeout: float | None = 60.0,
        params: dict[str, str] | None = None,
    ) -> Any:  # fmt: skip
        return await self._http.call(method, path, body, timeout=timeout, params=params)

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> Completion:
        """Generate ``request`` on the server; its completion once it ends."""
        rid, p = request.request_id, request.params
        params = {
            "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
            "stop_token_ids": list(p.stop_token_ids), "seed": p.seed, "logprobs": 0,
            "ignore_eos": True, "detokenize": False,
        }  # fmt: skip
        body = {"request_id": rid, "token_ids": list(request.prompt_ids), "sampling_params": params}
        with self._requests.running(request):
            out = await self._call("POST", "/inference/v1/generate", body, timeout=None)
        return self._completion(request, out["choices"][0])

    def _completion(self, request: GenerateRequest, choice: dict[str, Any]) -> Completion:
        tokens = choice.get("token_ids") or []
        logprobs = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
        spans = [(s["version"], s["start"], s["end"]) for s in choice.get("weight_versions") or ()]
        reason = choice.get("finish_reason")
        return self._requests.completion(request, tokens, logprobs, reason, spans)

    async def abort_requests(self, ids: Sequence[str] | None = None) -> int:
        """End these requests (every one in flight with None) now, with their tokens so
        far; how many were in flight."""
        targets = self._requests.in_flight(ids)
        if targets:
            await self._call("POST", "/abort_requests",
                             {"request_ids": [_PREFIX + i for i in targets]})  # fmt: skip
        return len(targets)

    # -- pause ------------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "keep") -> None:
        if mode not in _MODES:
            raise RequestError(f"pause: mode: expected 'keep', 'abort' or 'wait', got {mode!r}")
        await self._call("POST", "/pause", params={"mode": mode})
        self._paused = True

    async def resume(self) -> None:
        """Undo :meth:`pause` (not while the model holds a mix of versions)."""
        self._paused = False
        await self._settle()
        if self._refusing is None:
            await self._call("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._call("GET", "/is_paused"))["is_paused"])

    # -- weights ----------------------------------------------------------------------------
    async def init_weight_transfer(
        self, group: str, address: str, *, secret: str | None = None, timeout: float = 30.0
    ) -> None:
        """Have the server's workers join the trainer's ``WeightSender`` of ``group`` at
        ``address`` (their receivers are named after this engine)."""
        info: dict[str, Any] = {"group": group, "address": address, "name": self.name,
                                "timeout": timeout}  # fmt: skip
        if secret is not None:
            info["secret"] = secret
        await self._call("POST", "/init_weight_transfer_engine", {"init_info": info},
                         timeout=timeout + 30.0)  # fmt: skip

    async def start_weight_update(self) -> None:
        await self._settle()
        if self._update is not None:
            raise EngineError(self.name, "start_weight_update: an update is in progress already")
        await self._call("POST", "/start_weight_update")
        info = {"version": None, "timeout": self.update_timeout}
        self._update = asyncio.ensure_future(self._timed_update(info))

    async def _timed_update(self, info: dict[str, Any]) -> None:
        t0 = time.monotonic()
        try:
            await self._call("POST", "/update_weights", {"update_info": info},
                             timeout=self.update_timeout + 30.0)  # fmt: skip
        finally:
            self._update_seconds += time.monotonic() - t0
            self._updates += 1

    async def finish_weight_update(self, version: int) -> None:
        """Serve ``version`` if the push committed it whole, or if it is the version served
        already and the model is whole (the push never came or was refused before it
        loaded anything: the update ends there); else raise ``EngineError`` (and stay
        paused if the model holds a mix)."""
        if type(version) is not int:
            raise TypeError(f"finish_weight_update: expected an int version, got {version!r}")
        task, self._update = self._update, None
        if task is None:
            raise EngineError(
                self.name,
                f"finish_weight_update({version}): no update in progress "
                "(call start_weight_update first)",
            )
        what = f"finish_weight_update({version})"
        try:
            await task
        except EngineError as e:
            state = await self._state()
            if version == self._requests.version_of() and not state.get("mixed"):
                # no push committed and the model is whole: end the update on what it serves
                await self._call(
                    "POST", "/finish_weight_update", {"weight_version": self._requests.label}
                )
                self._error = f"{what}: the update ended there: {state.get('error') or e}"
                return
            raise EngineError(self.name, await self._failed(what, str(e))) from None
        got = (await self._state()).get("version")
        if got != version:
            why = f"expected version {version} committed, got version {got}"
            raise EngineError(self.name, await self._failed(what, why))
        await self._call("POST", "/finish_weight_update", {"weight_version": str(version)})
        self._requests.label, self._refusing, self._error = str(version), None, None
        if not self._paused:  # a refusing engine that the coordinator resumed already
            await self._call("POST", "/resume")

    async def _failed(self, what: str, reason: str) -> str:
        """Record a failed update (the workers' own reason when they have one); with a
        mixed model the engine refuses to serve."""
        state = await self._state()
        why = f"{what}: {state.get('error') or reason}"
        if state.get("mixed"):
            why += "; the model holds a mix: no request runs until a version commits whole"
            self._refusing = why
        self._error = why
        return why

    async def _settle(self) -> None:
        """Take an update that ends without ``finish_weight_update`` (the coordinator
        skips it for an engine whose push failed): wait for the server's answer, note
        why it failed and whether the model holds a mix."""
        task = self._update
        if task is None:
            return
        if not task.done():  # a failed push: the server's /update_weights ends at once
            await asyncio.wait([task], timeout=self.update_timeout + 30.0)
            if not task.done():
                return
        self._update = None
        if task.cancelled() or task.exception() is not None:
            await self._failed("an update without finish_weight_update", "it failed")

    async def _state(self) -> dict[str, Any]:
        """The first worker's receiver state (the extension's ``rlferry_state``)."""
        out = await self._call("POST", "/collective_rpc", {"method": "rlferry_state"})
        results = (out or {}).get("results") or [{}]
        return dict(results[0])

    async def get_weight_version(self) -> int | None:
        label = (await self._call("GET", "/weight_info"))["weight_version"]
        return self._requests.version_of(str(label))

    async def statistics(self) -> EngineStatistics:
        """``step_seconds``: seconds with a request in flight; ``steps``: 0."""
        r = self._requests
        return EngineStatistics(
            name=self.name, version=r.version_of(),
            paused=self._paused or self._refusing is not None, running=len(r.inflight),
            waiting=0, finished=r.counts["finished"], aborted=r.counts["aborted"],
            tokens=r.counts["tokens"], steps=0, step_seconds=r.busy_seconds(),
            paused_seconds=0.0, updates=self._updates, update_seconds=self._update_seconds,
            last_error=self._error,
        )  # fmt: skip

    async def aclose(self) -> None:
        """Close the HTTP session (the server keeps running); a second call does nothing."""
        update, self._update = self._update, None
        if update is not None:  # an update in flight: nobody will finish it
            update.cancel()
        await self._http.aclose()
