"""A push's gate: how an engine's receivers load a push between its steps.

The first bucket of a push stops stepping until the push commits, so that a token never
comes from a mix of versions. A bucket that comes while a step is in progress either
waits for that step to end, or, with ``stage_pushes``, is copied aside and loaded at the
step's end (:mod:`._staging`): its sender goes on meanwhile. The receivers' threads call
:meth:`LoadGate._load` and :meth:`LoadGate._commit`; the decode thread calls
:meth:`LoadGate._step_ended`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rlferry.control import EngineError

from ._lora import ServedAdapter
from ._model import NonFinite, check_finite
from ._staging import Staging
from ._thread import STEP_BOUND, DecodeThread

__all__ = ["LoadGate"]


class LoadGate(DecodeThread):
    """The decode thread with its push gate (see the module)."""

    adapter: ServedAdapter | None  # the engine's LoRA adapter slots, set by the engine
    _check_finite: bool  # refuse a bucket that holds NaN or Inf, set by the engine

    def __init__(self, *args: Any, stage_pushes: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # a push's buckets copied aside while a step runs (None: they wait for it)
        self._staging = Staging() if stage_pushes else None

    def _commit(self, version: int) -> None:
        if self.adapter is not None:
            self.adapter.committed()
        self._on_commit(version)

    def _load(
        self, loader: Callable[[list[tuple[str, torch.Tensor]]], Any],
        items: list[tuple[str, torch.Tensor]],
    ) -> None:  # fmt: skip
        """The receiver's ``load``: stop stepping at the push's first bucket, then copy
        (into the model, or aside while a step is in progress: :mod:`._staging`). Sharded,
        every trainer rank's bucket comes on a thread of its own."""
        staged = self._stop_for_load(Staging.can_stage(items))
        try:
            if self._check_finite:
                check_finite(items)
            if staged:
                assert self._staging is not None
                self._staging.stage(loader, items)
            else:
                loader(items)
        except Exception as e:
            self._load_failed(e, refused=isinstance(e, NonFinite))
            raise
        self._loaded()

    def _stop_for_load(self, can_stage: bool) -> bool:
        """Stop stepping (at a push's first bucket); True: stage this bucket (a step is in
        progress and ``can_stage``), else once the step in progress ended (and the last
        push's staged buckets were loaded); raise ``EngineError`` if it does not within
        ``STEP_BOUND``."""
        with self._cond:
            first = not self._loading
            if first:
                self._loading = True
                self._load_error = None
                if self._update_since is None:
                    self._update_since = time.monotonic()
                self._gate_changed()
            st = self._staging
            if st is not None and can_stage and self._in_step and not st.committed:
                return True
            if not self._cond.wait_for(lambda: not self._in_step, STEP_BOUND):
                if first:
                    self._loading = False
                    self._gate_changed()
                raise EngineError(
                    self.name, f"its decode step did not end within {STEP_BOUND:g} s, so "
                    "the push was not loaded (a step that long is a bug: please report it)",
                )  # fmt: skip
            return False

    def _loaded(self) -> None:
        """A bucket of the push loaded."""
        with self._cond:
            self._since_commit += 1

    def _load_failed(self, e: Exception, *, refused: bool) -> None:
        """A bucket failed to load: ``refused`` before anything was copied (the model is
        still whole if no bucket of the push loaded before), else the model holds a mix
        and no step runs until a version commits whole."""
        with self._cond:
            if self._staging is not None:
                self._staging.drop()
            self._load_error = f"{type(e).__name__}: {e}"
            if refused and self._since_commit == 0:
                self._loading = False  # nothing was loaded: the model is still whole
                if not self._updating:
                    self._update_since = None
                self._error = f"weights: a push was refused before loading ({e})"
            else:
                self._error = (
                    f"weights: a push failed after {self._since_commit} of its buckets "
                    f"were loaded ({type(e).__name__}: {e}); the model holds a mix of "
                    "versions: no step runs until a version commits whole"
                )
            self._gate_changed()

    def _on_commit(self, version: int) -> None:
        """The receiver committed ``version`` whole: it is served from the next step."""
        with self._cond:
            if self._staging is not None and self._staging.pending:
                self._staging.committed = True
                if not self._in_step:
                    self._staging.load()
            self._version = version
            self._loading = False
            self._refusing = None
            self._load_error = None
            self._since_commit = 0
            self._counts["updates"] += 1
            if not self._updating:
                self._update_done()
            self._gate_changed()

    def _wait_loaded(self) -> None:
        """Wait for a committed push's staged buckets to load (at the end of the step in
        progress); raise ``EngineError`` if they do not within ``STEP_BOUND``."""
        with self._cond:
            st = self._staging
            if st is not None and not self._cond.wait_for(lambda: not st.committed, STEP_BOUND):
                raise EngineError(
                    self.name, f"its decode step did not end within {STEP_BOUND:g} s, so the "
                    "last push is not loaded yet (a step that long is a bug: please report it)",
                )  # fmt: skip

    def _step_ended(self) -> None:
        if self._staging is not None and self._staging.committed:
            self._staging.load()  # a push committed during the step: loaded before the next
