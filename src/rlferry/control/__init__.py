"""The control plane: engines, versions, staleness, pause -> sync -> resume.

Generation engines implement :class:`Engine` (named after vLLM's native RL API); a
coordinator drives them: it routes rollout requests, bounds how stale a trained sample
may be, and runs each weight update as pause -> push -> commit -> resume. Completions
are pushed by the engines, never polled.
"""

from ._engine import (
    Completion,
    Engine,
    EngineError,
    EngineStatistics,
    FinishReason,
    GenerateRequest,
    PauseMode,
    SamplingParams,
)

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "EngineStatistics",
    "FinishReason",
    "GenerateRequest",
    "PauseMode",
    "SamplingParams",
]
