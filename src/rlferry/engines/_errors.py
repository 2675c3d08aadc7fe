"""The engine adapters' own error: a call that needs a started resource."""

from __future__ import annotations

from rlferry.control import ControlError
from rlferry.errors import Closed

__all__ = ["NotStarted"]


class NotStarted(ControlError, Closed, RuntimeError):
    """A call that needs a started resource came before its start (or after its close):
    ``SGLangWeights.push`` before ``start()``, a weight update of rlferry's vLLM backend
    before ``init_weight_transfer_engine``. The message names the call to make first.

    A :class:`rlferry.errors.Closed`: like a closed resource, this one is not open for the
    call, and waiting does not help (``Gone`` and ``Timeout`` are for peers; nothing the
    caller passed is wrong, so it is no ``RequestError``). Also a ``RuntimeError``, the
    builtin these calls raised."""
