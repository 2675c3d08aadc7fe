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

from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec

from rlferry.errors import RequestError

__all__ = [
    "Completion",
    "Engine",
    "EngineStatistics",
    "FinishReason",
    "GenerateRequest",
    "PauseMode",
    "SamplingParams",
]

PauseMode = Literal["keep", "abort", "wait"]
"""``keep``: in-flight requests stay where they are (KV cache kept) and continue after
``resume``; ``abort``: they end now with their partial tokens (finish reason ``abort``);
``wait``: no new request is admitted, in-flight ones finish, then the engine pauses."""

FinishReason = Literal["stop", "length", "abort"]


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
    """An engine's state and counters (since the engine started)."""

    name: str
    """The engine's name (its weight receivers are named after it)."""
    version: int | None
    """The whole weight version it serves (None: it does not know)."""
    paused: bool
    """Whether it is not stepping now (paused, updating weights, or refusing to step)."""
    running: int
    """Requests generating now."""
    waiting: int
    """Requests accepted and not generating yet."""
    finished: int
    """Requests that ended at a stop token or ``max_tokens``."""
    aborted: int
    """Requests that ended by an abort (finish reason ``abort``)."""
    tokens: int
    """Tokens generated."""
    steps: int
    """Forward passes run (0 where the engine does not count them)."""
    step_seconds: float
    """Seconds spent stepping (or with a request in flight, where the engine cannot say)."""
    paused_seconds: float
    """Seconds it did not step because a pause, an update or a refusal held it."""
    updates: int
    """Weight updates it ended."""
    update_seconds: float
    """Seconds spent in weight updates."""
    last_error: str | None
    """Why its last failed step or update failed (None: none failed)."""
    vocab_size: int | None = None
    """Token ids must be below it (None: the engine does not say; it checks itself)."""
    max_model_len: int | None = None
    """Prompt + ``max_tokens`` must fit in it (None: the engine does not say)."""
    loads_between_steps: bool = False
    """True: a push stops the engine's steps by itself (from its first bucket, at the end
    of the step in progress) and the engine serves the version from the step after it
    committed whole, or refuses to step while it holds a mix. An update in ``keep`` mode
    then needs no ``pause``, ``start_weight_update``, ``finish_weight_update`` or
    ``resume`` for it: its requests in flight go on, their later tokens on the new
    version (``Completion.versions`` says which)."""


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
