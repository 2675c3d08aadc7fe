"""What the vLLM adapters share: vLLM's weight-version labels as rlferry versions, and a
finished vLLM output as a :class:`rlferry.control.Completion` (no vLLM import here)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rlferry.control import Completion, EngineError, GenerateRequest

__all__ = ["completion", "version_of"]

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
