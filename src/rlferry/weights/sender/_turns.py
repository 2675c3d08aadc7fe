"""A push's steps, driven: one push to its end, or several in turn by one thread (a
rank's links on NCCL, where a step only enqueues GPU work)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar

__all__ = ["drain", "take_turns"]

T = TypeVar("T")


def drain(steps: Generator[bool | None, None, T]) -> T:
    """Run a push's :meth:`Pusher.steps` to its end; its report. Interrupted between two
    steps (a Ctrl-C lands here as often as in a step), the push is closed: it aborts and
    lets its sender go (left suspended, it would hold the sender's lock, and its receivers
    would wait for buckets that never come)."""
    try:
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
    finally:
        steps.close()


def take_turns(
    steps: dict[int, Generator[bool | None, None, Any]],
    reports: dict[int, Any],
    errors: dict[int, BaseException],
) -> None:
    """Run every push's steps in turn in this thread (round robin), each to its end (its
    report in ``reports``) or its error (in ``errors``); an interrupt closes every push
    still going (each aborts) and goes up.

    A step that yields True says its next one blocks this thread (until the GPU sent its
    buckets, or its receivers committed): it is resumed only once every other push
    reached such a step too, the longest parked first, so every link's buckets are
    enqueued before the thread blocks on any. A link that ended first must not block the
    thread while another link's later buckets are not enqueued: that link's receives
    would wait on this thread, and an engine rank loading a kernel meanwhile (CUDA waits
    for the device's running kernels) would hang.
    """
    going = dict(steps)
    ready: list[int] = list(going)  # pushes to step
    parked: list[int] = []  # pushes whose next step blocks
    try:
        while ready or parked:
            turn, ready = (ready, []) if ready else ([parked.pop(0)], ready)
            for r in turn:
                try:
                    blocks = next(going[r])
                except StopIteration as done:
                    reports[r] = done.value
                    del going[r]
                except Exception as e:
                    errors[r] = e
                    del going[r]
                else:
                    (parked if blocks else ready).append(r)
    finally:
        for g in going.values():
            g.close()
