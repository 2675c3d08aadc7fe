"""The control plane: engines, versions, staleness, pause -> sync -> resume.

Generation engines implement :class:`Engine` (named after vLLM's native RL API); a
coordinator drives them: it routes rollout requests, bounds how stale a trained sample
may be, and runs each weight update as pause -> push -> commit -> resume. Completions
are pushed by the engines, never polled.
"""

from ._coordinator import Coordinator, CoordinatorStatistics, Group, UpdateReport
from ._engine import (
    Completion,
    Engine,
    EngineClosed,
    EngineError,
    EngineGone,
    EngineStatistics,
    FinishReason,
    GenerateRequest,
    PauseMode,
    RequestError,
    SamplingParams,
    WeightUpdateError,
)
from ._metrics import register_metrics
from ._remote import RemoteEngine
from ._rollouts import put_groups, rollout_columns
from ._server import EngineServer

__all__ = [
    "Completion",
    "Coordinator",
    "CoordinatorStatistics",
    "Engine",
    "EngineClosed",
    "EngineError",
    "EngineGone",
    "EngineServer",
    "EngineStatistics",
    "FinishReason",
    "GenerateRequest",
    "Group",
    "PauseMode",
    "RemoteEngine",
    "RequestError",
    "SamplingParams",
    "UpdateReport",
    "WeightUpdateError",
    "put_groups",
    "register_metrics",
    "rollout_columns",
]
