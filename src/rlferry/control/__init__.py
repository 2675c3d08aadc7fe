"""The control plane: engines, versions, staleness, pause -> sync -> resume.

Generation engines implement :class:`Engine` (named after vLLM's native RL API); a
coordinator drives them: it routes rollout requests, bounds how stale a trained sample
may be, and runs each weight update as pause -> push -> commit -> resume. Completions
are pushed by the engines, never polled.

Also importable from here, outside ``__all__``: :class:`CoordinatorStatistics` (what
``Coordinator.statistics()`` returns), ``FinishReason`` (a completion's finish reasons)
and ``RequestError`` (:class:`rlferry.errors.RequestError`, its home).
"""

from rlferry.errors import RequestError as RequestError

from ._coordinator import Coordinator, Group, UpdateReport
from ._engine import (
    Completion,
    Engine,
    EngineStatistics,
    GenerateRequest,
    PauseMode,
    SamplingParams,
)
from ._engine import FinishReason as FinishReason
from ._errors import (
    ControlError,
    CoordinatorTimeout,
    EngineClosed,
    EngineError,
    EngineGone,
    WeightUpdateError,
)
from ._metrics import register_metrics
from ._records import CoordinatorStatistics as CoordinatorStatistics
from ._remote import RemoteEngine
from ._rollouts import put_groups, rollout_columns
from ._server import EngineServer

__all__ = [
    "Completion",
    "ControlError",
    "Coordinator",
    "CoordinatorTimeout",
    "Engine",
    "EngineClosed",
    "EngineError",
    "EngineGone",
    "EngineServer",
    "EngineStatistics",
    "GenerateRequest",
    "Group",
    "PauseMode",
    "RemoteEngine",
    "SamplingParams",
    "UpdateReport",
    "WeightUpdateError",
    "put_groups",
    "register_metrics",
    "rollout_columns",
]
