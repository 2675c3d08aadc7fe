"""The engine protocol: what the coordinator asks of a generation engine, and the data of it.

Named after vLLM's native RL API (``pause(mode)``, ``resume``, ``is_paused``,
``abort_requests``, ``start_weight_update``, ``finish_weight_update``,
``get_weight_version``), so that adapters of vLLM and SGLang are thin. Every method
is a coroutine: an in-process engine (``rlferry.engines.hf.HFEngine``) and a remote
one (``RemoteEngine``, over HTTP) fit alike.

Weights never travel in these calls: an engine holds a ``rlferry.weights.WeightReceiver``
(``init_weight_transfer`` names the sender) and the trainer's ``WeightSender`` streams
into it.

The data are frozen ``msgspec.Struct``s: they cross processes as JSON or msgpack, never
pickled, and are checked on construction.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec

from rlferry.errors import Gone, RequestError, RlferryError

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "EngineGone",
    "EngineStatistics",
    "FinishReason",
    "GenerateRequest",
    "PauseMode",
    "RequestError",
    "SamplingParams",
    "WeightUpdateError",
]

PauseMode = Literal["keep", "abort", "wait"]
"""``keep``: in-flight requests stay where they are (KV cache kept) and continue after
``resume``; ``abort``: they end now with their partial tokens (finish reason ``abort``);
``wait``: no new request is admitted, in-flight ones finish, then the engine pauses."""

FinishReason = Literal["stop", "length", "abort"]


class EngineError(RlferryError):
    """An engine failed a request or a step of a weight update; ``engine`` names it (the
    engines, comma-separated, for an update that several failed: ``failures`` maps each
    name to its reason). The control plane's base error. Where the engine answered, it
    refused or failed this one step and serves on; where it is unreachable, closed or
    dead the error is an :class:`EngineGone`."""

    gone = False
    """True for an :class:`EngineGone`: the engine serves nothing until it is added again."""

    def __new__(cls, *args: object, gone: bool | None = None, **kwargs: object) -> EngineError:
        if gone is not None:  # the 0.1 spelling of EngineGone, kept for one release
            warnings.warn(
                "EngineError(..., gone=...) is deprecated: raise EngineGone(...) for an engine "
                "that is gone",
                DeprecationWarning,
                stacklevel=2,
            )
            if gone and cls is EngineError:
                cls = EngineGone
        return super().__new__(cls, *args)

    def __init__(
        self,
        engine: str,
        message: str,
        failures: dict[str, str] | None = None,
        *,
        gone: bool | None = None,
    ) -> None:
        super().__init__(f"engine `{engine}`: {message}")
        self.engine = engine
        self.reason = message
        self.failures = dict(failures or {engine: message})


class EngineGone(EngineError, Gone):
    """The engine is unreachable, closed or dead (a lost connection, an answer that never
    came, a process that exited): it serves nothing until it is added again."""

    gone = True


class WeightUpdateError(EngineError):
    """A weight update that failed somewhere. ``stage`` is where the first failure happened
    (``pause``, ``start_weight_update``, ``push``, ``finish_weight_update``, ``resume``);
    ``failures`` maps each party at fault (an engine's name, or ``push`` for the trainer's
    push itself) to its stage and reason, and names no one else; ``serving`` maps every
    engine that serves after the update to the version it serves; ``waiting`` maps the
    engines that are not at fault but serve nothing until a later update reaches them (a
    push that failed after they loaded part of it) to why. ``version`` is the trainer's
    version after the update: the new one if any engine committed it, else unchanged (retry
    the same version)."""

    def __init__(
        self,
        target: int,
        stage: str,
        failures: dict[str, str],
        serving: dict[str, int | None],
        waiting: dict[str, str],
        version: int,
    ) -> None:
        parts = [f"`{name}`: {why}" for name, why in failures.items()]
        if serving:
            at = sorted({v for v in serving.values() if v is not None})
            parts.append(
                f"{len(serving)} engine(s) serve version {', '.join(map(str, at)) or '?'}: "
                + ", ".join(serving)
            )
        parts += [f"`{name}` waits for the next update: {why}" for name, why in waiting.items()]
        if version < target:
            parts.append(f"the trainer's version stays {version} (retry version {target})")
        names = ", ".join(failures) or "(none)"
        super().__init__(
            names, f"weight update to version {target} failed at {stage}: " + "; ".join(parts),
            failures,
        )  # fmt: skip
        self.stage = stage
        self.target = target
        self.serving = dict(serving)
        self.waiting = dict(waiting)
        self.version = version


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample. ``temperature=0`` is greedy; ``top_p`` keeps the smallest set of
    tokens whose probability reaches it; generation ends at ``max_tokens`` (finish reason
    ``length``) or after a token of ``stop_token_ids`` (``stop``, the token kept);
    ``seed`` makes sampling repeatable per request."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise RequestError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise RequestError(f"temperature: expected a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not all(type(t) is int and t >= 0 for t in self.stop_token_ids):
            raise RequestError(
                f"stop_token_ids: expected token ids (ints >= 0), got {self.stop_token_ids!r}"
            )
        if self.seed is not None and type(self.seed) is not int:
            raise RequestError(f"seed: expected None or an int, got {self.seed!r}")


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One sequence to generate from ``prompt_ids``. ``request_id`` is unique per engine
    (``abort_requests`` names it)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = SamplingParams()

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RequestError(f"request_id: expected a non-empty str, got {self.request_id!r}")
        if not self.prompt_ids or not all(type(t) is int and t >= 0 for t in self.prompt_ids):
            raise RequestError(
                "prompt_ids: expected a non-empty list of token ids (ints >= 0), "
                f"got {self.prompt_ids[:8]!r}"
            )


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A finished request: the tokens generated after the prompt, each one's log
    probability under the sampling distribution (``log_softmax(logits / temperature)``,
    before top-p; temperature 1 for greedy), and the weight version of the forward pass
    that produced it."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    engine: str = ""

    @property
    def version_start(self) -> int:
        """The version of the first token (the prompt's, for an empty completion)."""
        return self.versions[0] if self.versions else -1

    @property
    def version_end(self) -> int:
        return self.versions[-1] if self.versions else -1


class EngineStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """An engine's state and counters."""

    name: str
    version: int | None
    paused: bool
    running: int
    waiting: int
    finished: int
    aborted: int
    tokens: int
    steps: int
    step_seconds: float
    paused_seconds: float
    updates: int
    update_seconds: float
    last_error: str | None
    vocab_size: int | None = None
    """Token ids must be below it (None: the engine does not say; it checks itself)."""
    max_model_len: int | None = None
    """Prompt + ``max_tokens`` must fit in it (None: the engine does not say)."""


@runtime_checkable
class Engine(Protocol):
    """A generation engine as the coordinator drives it. Every method may raise
    :class:`EngineError`; none blocks the event loop."""

    name: str

    async def generate(self, request: GenerateRequest) -> Completion:
        """Generate until a stop token, ``max_tokens`` or an abort; the completion is the
        answer (pushed when it is done: nothing polls)."""
        ...

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Return once the engine is paused (at most one decode step later for ``keep``
        and ``abort``; once in-flight requests finished for ``wait``)."""
        ...

    async def resume(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def abort_requests(self, ids: Sequence[str] | None = None) -> int:
        """End these requests (all with None) now, with their partial tokens; how many."""
        ...

    async def init_weight_transfer(self, group: str, address: str) -> None:
        """Join the trainer's ``WeightSender`` of ``group`` at ``address``."""
        ...

    async def start_weight_update(self) -> None:
        """No decode step runs from now until ``finish_weight_update``."""
        ...

    async def finish_weight_update(self, version: int) -> None:
        """Serve ``version``, which must have been committed whole; else raise
        :class:`EngineError` and keep refusing to generate until a whole version comes."""
        ...

    async def get_weight_version(self) -> int | None: ...

    async def statistics(self) -> EngineStatistics: ...
