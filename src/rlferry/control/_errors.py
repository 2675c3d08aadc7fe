"""The control plane's errors: each a :class:`ControlError` and one of the families of
:mod:`rlferry.errors`.

- :class:`EngineError`: an engine failed a request or a step of an update (it serves on);
  :class:`EngineGone` (a ``Gone``): it is unreachable, closed or dead;
  :class:`EngineClosed` (a ``Closed`` and an ``EngineGone``): its owner closed it, or the
  coordinator (named ``coordinator``) was closed; :class:`WeightUpdateError`: an update
  that failed, naming only the parties at fault.
- :class:`CoordinatorTimeout` (a ``Timeout``, so a ``TimeoutError``): a bounded wait of
  the coordinator ended; the message says what it waited for and why no engine served.
- A request an engine refuses is an :class:`rlferry.errors.RequestError` (a
  ``ValueError``) naming the engine: it fails that request only.
"""

from __future__ import annotations

import warnings

from rlferry.errors import Closed, Gone, RlferryError, Timeout

__all__ = [
    "ControlError",
    "CoordinatorTimeout",
    "EngineClosed",
    "EngineError",
    "EngineGone",
    "WeightUpdateError",
]


class ControlError(RlferryError):
    """The base of the control plane's errors (the coordinator's, the engines')."""


class EngineError(ControlError):
    """An engine failed a request or a step of a weight update; ``engine`` names it (the
    engines, comma-separated, for an update that several failed: ``failures`` maps each
    name to its reason). Where the engine answered, it refused or failed this one step and
    serves on; where it is unreachable, closed or dead the error is an
    :class:`EngineGone`."""

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


class EngineClosed(EngineGone, Closed):
    """The engine was closed by its owner (``close()`` / ``aclose()``), then used: the calls
    in flight when it closed and every later one fail with it (make a new engine). It is
    an :class:`EngineGone` too: to a coordinator, a closed engine is gone."""


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


class CoordinatorTimeout(ControlError, Timeout):
    """A bounded wait of the coordinator ended (admission by ``submit``, groups for
    ``batch``, an engine that serves for a sample): the message says what it waited for,
    for how long, how many engines serve and why each other one does not."""
