"""A push's steps, driven: one push to its end, or several in turn by one thread (a
rank's links on NCCL, where a step only enqueues GPU work)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar

__all__ = ["drain", "take_turns"]

T = TypeVar("T")


def drain(steps: Generator[None, None, T]) -> T:
    """Run a push's :meth:`WeightSender._steps` to its end; its report."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def take_turns(
    steps: dict[int, Generator[None, None, Any]],
    reports: dict[int, Any],
    errors: dict[int, BaseException],
) -> None:
    """Run every push's steps in turn in this thread (round robin), each to its end (its
    report in ``reports``) or its error (in ``errors``); an interrupt closes every push
    still going (each aborts) and goes up."""
    going = dict(steps)
    try:
        while going:
            for r, g in list(going.items()):
                try:
                    next(g)
                except StopIteration as done:
                    reports[r] = done.value
                    del going[r]
                except Exception as e:
                    errors[r] = e
                    del going[r]
    finally:
        for g in going.values():
            g.close()
