"""What the vLLM adapters share: vLLM's weight-version labels as rlferry versions, a
finished vLLM output as a :class:`rlferry.control.Completion`, the requests in flight
(no vLLM import here)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence

from rlferry.control import Completion, EngineError, GenerateRequest, RequestError

__all__ = ["Requests", "completion", "version_of"]

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
