"""SGLang: an :class:`~rlferry.control.Engine` over an SGLang server's HTTP API, and the
trainer's side of SGLang's weight update.

Written against SGLang 0.5.23's routes and request classes (``io_struct.py``,
``http_server.py``); tested against a server that checks every request against those
classes' fields, not against a live SGLang (it needs a GPU).

- ``generate``: ``POST /generate`` with ``input_ids``, ``sampling_params`` and
  ``return_logprob``; per-token logprobs from ``meta_info.output_token_logprobs``,
  per-token versions from ``meta_info.weight_versions`` (the spans SGLang records
  when a weight update lands mid-request; rlferry labels versions ``str(int)``).
- ``pause``: ``keep`` is SGLang's ``in_place`` (requests stay, KV cache kept), ``abort``
  its ``abort`` (requests end now with their partial tokens); ``wait`` has no SGLang
  mode: the adapter holds new requests, waits (by event) for its requests in flight
  to end, then pauses ``in_place``. ``resume`` is ``POST /continue_generation``.
- Weights: SGLang joins a ``torch.distributed`` group with the trainer
  (``/init_weights_update_group``) and receives a broadcast per tensor
  (``/update_weights_from_distributed``, with ``weight_version`` so its answers carry
  the version). :class:`SGLangWeights` is the trainer's side: it forms the group the
  way SGLang's ``init_custom_process_group`` does and broadcasts each tensor while the
  update request runs. rlferry's own ``WeightSender`` protocol is not SGLang's, so
  ``init_weight_transfer`` is refused with that explanation.
"""

from __future__ import annotations

import asyncio
import datetime
import warnings
from collections.abc import Iterable, Sequence
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
from rlferry.wire.lowlevel import AsyncResource

from .._errors import NotStarted
from .._http import JsonClient

__all__ = ["SGLangEngine", "SGLangWeights"]

CONTROL_TIMEOUT = 60.0
_MODES = {"keep": "in_place", "abort": "abort"}
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangEngine(AsyncResource):
    """An SGLang server as an rlferry engine. ``version``: the version of the weights the
    server starts with (its label ``"default"`` reads as it). :meth:`aclose` (or ``async
    with``) closes its HTTP client (the server keeps running); later calls raise
    :class:`~rlferry.control.EngineClosed`."""

    def __init__(
        self, url: str, *, name: str | None = None, api_key: str | None = None, version: int = 0
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise RequestError(f"url: expected http://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self.name = name or self.url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = JsonClient(self.name, self.url, headers)
        self._version = version
        self._paused = False
        self._open = asyncio.Event()  # set while new requests may go to the server
        self._open.set()
        self._running = 0
        self._idle = asyncio.Event()  # set while no request of ours is in flight
        self._idle.set()
        self._counts = dict.fromkeys(("finished", "aborted", "tokens", "updates"), 0)

    # -- HTTP -------------------------------------------------------------------------
    async def _post(self, path: str, body: dict[str, Any], timeout: float | None) -> Any:
        return await self._http.call("POST", path, body, timeout=timeout)

    # -- requests ---------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> Completion:
        await self._open.wait()  # a pause("wait") holds new requests here until resume
        p = request.params
        sampling: dict[str, Any] = {
            "max_new_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": -1,
            "stop_token_ids": list(p.stop_token_ids) or None,
            "no_stop_trim": True,  # the stop token is part of the response, as rlferry's
            "skip_special_tokens": False,
        }
        if p.seed is not None:
            sampling["sampling_seed"] = p.seed
        body = {
            "rid": request.request_id,
            "input_ids": request.prompt_ids,
            "sampling_params": sampling,
            "return_logprob": True,
        }
        self._running += 1
        self._idle.clear()
        try:
            out = await self._post("/generate", body, None)
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()
        return self._completion(request, out)

    def _completion(self, request: GenerateRequest, out: Any) -> Completion:
        try:
            tokens = [int(t) for t in out["output_ids"]]
            meta = out["meta_info"]
            logprobs = [float(lp[0]) for lp in meta["output_token_logprobs"]]
            reason = meta.get("finish_reason") or {}
            kind = reason.get("type") if isinstance(reason, dict) else str(reason)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise EngineError(
                self.name, f"/generate: an answer that is not SGLang's ({type(e).__name__}: {e})"
            ) from None
        versions = self._versions(meta, len(tokens))
        finish = _FINISH.get(str(kind), "stop")
        self._counts["aborted" if finish == "abort" else "finished"] += 1
        self._counts["tokens"] += len(tokens)
        return Completion(
            request_id=request.request_id, prompt_ids=request.prompt_ids, token_ids=tokens,
            logprobs=logprobs, versions=versions, finish_reason=finish,  # type: ignore[arg-type]
            engine=self.name,
        )  # fmt: skip

    def _versions(self, meta: dict[str, Any], n: int) -> list[int]:
        """Per token, from SGLang's spans (``[{version, start, end}]``); without spans, the
        answer's one ``weight_version`` for every token."""
        spans = meta.get("weight_versions")
        if not spans:
            return [self._label(meta.get("weight_version"))] * n
        out = [self._version] * n
        for span in spans:
            v = self._label(span["version"])
            for i in range(max(0, int(span["start"])), min(n, int(span["end"]))):
                out[i] = v
        return out

    def _label(self, label: Any) -> int:
        if label is None or label == "default":
            return self._version if self._counts["updates"] == 0 else 0
        try:
            return int(label)
        except (TypeError, ValueError):
            raise EngineError(
                self.name,
                f"weight_version: expected an integer label (rlferry sets str(version)), "
                f"got {label!r}",
            ) from None

    async def pause(self, mode: PauseMode = "keep") -> None:
        if mode not in ("keep", "abort", "wait"):
            raise RequestError(f"mode: expected 'keep', 'abort' or 'wait', got {mode!r}")
        if mode == "wait":
            self._open.clear()
            await self._idle.wait()  # our requests in flight end (each is bounded)
        await self._post(
            "/pause_generation", {"mode": _MODES.get(mode, "in_place")}, CONTROL_TIMEOUT
        )
        self._paused = True

    async def resume(self) -> None:
        await self._post("/continue_generation", {}, CONTROL_TIMEOUT)
        self._paused = False
        self._open.set()

    async def is_paused(self) -> bool:
        return self._paused

    async def abort_requests(self, ids: Sequence[str] | None = None) -> int:
        if ids is None:
            await self._post("/abort_request", {"abort_all": True}, CONTROL_TIMEOUT)
            return self._running
        for rid in ids:
            await self._post("/abort_request", {"rid": rid}, CONTROL_TIMEOUT)
        return len(ids)

    async def init_weight_transfer(self, group: str, address: str) -> None:
        raise EngineError(
            self.name,
            "an SGLang server takes weights by its own protocol (a torch.distributed group "
            "and a broadcast per tensor), not from a WeightSender: use SGLangWeights",
        )

    async def start_weight_update(self) -> None:
        """SGLang loads a broadcast between its steps: nothing to do before it."""

    async def finish_weight_update(self, version: int) -> None:
        """The version was set by the update request (``weight_version``)."""
        self._version = version
        self._counts["updates"] += 1

    async def get_weight_version(self) -> int | None:
        return self._version

    async def statistics(self) -> EngineStatistics:
        c = self._counts
        return EngineStatistics(
            name=self.name, version=self._version, paused=self._paused, running=self._running,
            waiting=0, finished=c["finished"], aborted=c["aborted"], tokens=c["tokens"],
            steps=0, step_seconds=0.0, paused_seconds=0.0, updates=c["updates"],
            update_seconds=0.0, last_error=None,
        )  # fmt: skip

    async def aclose(self) -> None:
        """Close the HTTP client (the server keeps running); a second call does nothing."""
        await self._http.aclose()


class SGLangWeights:
    """The trainer's side of SGLang's weight update: rank 0 of a ``torch.distributed``
    group with the servers, one broadcast per tensor.

    ``engines``: the servers, each with ``tp_size`` ranks (their ranks follow the
    trainer's, ``rank_offset`` 1, 1 + tp, ...). ``backend``: ``"nccl"`` for CUDA tensors,
    ``"gloo"`` for CPU ones. The group meets on a TCP store this process serves at
    ``master_address:master_port`` (loopback unless told otherwise), formed as SGLang's
    ``init_custom_process_group`` forms it (a store prefixed by the group's name).

    Lifecycle: ``await weights.start()`` forms the group; :meth:`close` (or ``with``;
    :meth:`aclose` or ``async with`` on the event loop) leaves it.
    """

    def __init__(
        self,
        engines: Sequence[SGLangEngine],
        *,
        backend: str = "nccl",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "rlferry",
        tp_size: int = 1,
        timeout: float = 120.0,
    ) -> None:
        if backend not in ("nccl", "gloo"):
            raise RequestError(f"backend: expected 'nccl' or 'gloo', got {backend!r}")
        self.engines = list(engines)
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.tp_size = tp_size
        self.timeout = timeout
        self.world_size = 1 + tp_size * len(self.engines)
        self._pg: Any = None

    async def start(self) -> SGLangWeights:
        """Form the group: every server is asked to join while this process joins as rank 0
        (each within ``timeout`` seconds); returns this object."""
        import torch.distributed as dist

        store = dist.TCPStore(
            self.master_address, self.master_port, self.world_size, True,
            timeout=datetime.timedelta(seconds=self.timeout), wait_for_workers=False,
        )  # fmt: skip
        self.master_port = store.port
        joins = [
            e._post("/init_weights_update_group", {
                "master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": 1 + i * self.tp_size, "world_size": self.world_size,
                "group_name": self.group_name, "backend": self.backend,
            }, self.timeout)
            for i, e in enumerate(self.engines)
        ]  # fmt: skip
        mine = asyncio.to_thread(self._join, store)
        results = await asyncio.gather(mine, *joins, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        return self

    async def init(self) -> None:
        """Deprecated: ``await weights.start()``."""
        warnings.warn(
            "SGLangWeights.init() is deprecated: use `await weights.start()`",
            DeprecationWarning,
            stacklevel=2,
        )
        await self.start()

    def _join(self, store: Any) -> None:
        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
        )

        prefixed = PrefixStore(self.group_name, store)
        self._pg, _ = _new_process_group_helper(
            self.world_size, 0, [], Backend(self.backend), prefixed,
            group_name=self.group_name,  # type: ignore[arg-type]
            timeout=datetime.timedelta(seconds=self.timeout),
        )  # fmt: skip
        # collectives go through the group object itself: no entry in torch's registry

    async def push(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Send every tensor (in order) to every server; each serves ``version`` once loaded.

        Raises:
            EngineError: a server refused the update (its answer names why).
            NotStarted: the group is not formed (call :meth:`start` first).
        """
        if self._pg is None:
            raise NotStarted("SGLangWeights.push: call start() first (the group is not formed)")
        tensors = list(named_tensors)
        body = {
            "names": [n for n, _ in tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
            "group_name": self.group_name,
            "weight_version": str(version),
            "flush_cache": True,
            "abort_all_requests": False,
        }
        updates = [asyncio.ensure_future(e._post("/update_weights_from_distributed", body,
                                                 self.timeout)) for e in self.engines]  # fmt: skip
        sending = asyncio.to_thread(self._broadcast, [t for _, t in tensors])
        sends = asyncio.ensure_future(sending)
        tasks = [sends, *updates]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if failed:  # a broken broadcast or a refused request: the rest cannot complete
            for t in pending:
                t.cancel()
            raise failed[0].exception()  # type: ignore[misc]
        for e, task in zip(self.engines, updates, strict=True):
            r = task.result()
            if isinstance(r, dict) and r.get("success") is False:
                raise EngineError(e.name, f"update_weights_from_distributed: {r.get('message')}")

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        for t in tensors:
            self._pg.broadcast([t.detach().contiguous()], options).wait()

    def close(self) -> None:
        """Leave the group (the servers see its connections close); a second call does
        nothing."""
        if self._pg is not None:
            pg, self._pg = self._pg, None
            pg.shutdown()

    async def aclose(self) -> None:
        """:meth:`close` on a worker thread (leaving the group may wait on the network)."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> SGLangWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> SGLangWeights:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
