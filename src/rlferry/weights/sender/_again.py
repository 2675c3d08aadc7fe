"""A push of the tensors the last push sent, found where they lay.

A trainer pushes the same tensors step after step (its parameters, or the copy its step
casts them into): same names, shapes, addresses, strides and dtypes. :class:`Again` reads
those of a push's pairs in one pass of attribute reads and, when they equal the last push's
and none of the last push's tensors moved since (their addresses), hands the pusher the
last push's own list, checked (``(pairs, True, None)``, as :meth:`Pusher.steps` takes a
callable): its layout is not checked again and, over a mailbox transport whose receivers
read the tensors in place, the pushing thread starts the push itself, without the wire
loop's round trips to pick the receivers and tell them (:meth:`Launcher.lean`). The old
list's tensors view the same memory in the same layout as the new ones, so reading either
reads the same bytes."""

from __future__ import annotations

import operator
from collections.abc import ItemsView
from typing import Any

import torch

from ..planning._specs import moved, where_of

__all__ = ["Again"]

_shape, _device = operator.attrgetter("shape"), operator.attrgetter("device")


class Again:
    """What a push's pairs are to the pusher: as given, or the last push's checked list."""

    def __init__(self) -> None:
        # the last push's list, its tensors and where they lay when it was given, swapped
        # as one (pushes from several threads read a triple that belongs together)
        self._last: tuple[list[Any], list[torch.Tensor], tuple[list[Any], ...]] | None = None

    def named(self, named: Any) -> Any:
        """``named`` (a list, tuple or items view of ``(name, tensor)``) as a list, or a
        callable giving the last push's list if its tensors lie where these do; any other
        iterable (a generator streams) as it is.

        The last list is taken only if none of its tensors moved since it was given (their
        addresses read again): a push may move them (shm zero copy moves a tensor that is
        not in shared memory there), and a new tensor may then lie where one of them lay,
        holding other values."""
        if not isinstance(named, (list, tuple, ItemsView)):
            self._last = None
            return named
        pairs = list(named)
        where = _where(pairs)
        last = self._last
        if last is not None and where and where == last[2] and not moved(last[1], where[3:]):
            kept = last[0]
            return lambda: (kept, True, None)
        self._last = (pairs, [t for _, t in pairs], where) if where else None
        return pairs

    def forget(self) -> None:
        """The last push failed: the next one is checked in full."""
        self._last = None


def _where(pairs: list[Any]) -> tuple[list[Any], ...]:
    """Names, shapes, devices and :func:`where_of` (addresses, strides, dtypes) of plain
    ``(str, Tensor)`` pairs, a list each (no tuple a tensor); () for others."""
    try:
        names, tensors = (list(x) for x in zip(*pairs, strict=True))
    except (TypeError, ValueError):
        return ()
    if not tensors or not set(map(type, tensors)) <= {torch.Tensor, torch.nn.Parameter}:
        return ()
    if not all(type(n) is str for n in names):
        return ()
    return (names, list(map(_shape, tensors)), list(map(_device, tensors)),
            *where_of(tensors, plain=True))  # fmt: skip
