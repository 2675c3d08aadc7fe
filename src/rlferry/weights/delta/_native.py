"""The optional C extension of the CPU diff and apply (``_fastdiff``), and its threads.

Built at install where a C compiler is; without it (``fastdiff`` None) the CPU diff and
apply run as torch ops, with the same bytes out.
"""

from __future__ import annotations

import os

try:  # built at install when a C compiler was there
    from . import _fastdiff as fastdiff
except ImportError:  # pragma: no cover - depends on the install
    fastdiff = None  # type: ignore[assignment]

__all__ = ["THREADS", "fastdiff"]

# Threads of one diff or apply: memory bandwidth stops growing long before this many cores.
THREADS = max(1, min(len(os.sched_getaffinity(0)), 8))
