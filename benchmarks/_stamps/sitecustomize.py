"""Stamps of a push's steps in every process of an ``rlferry demo`` run.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``: with this directory there
and ``RLFERRY_STAMPS=DIR`` set, every process of the run (the driver, the engines, the
trainer ranks) stamps the entry and exit of ``benchmarks/_demo_stamps.py``'s targets into
``DIR/<pid>.log`` as their modules are imported; that script merges them. Unset, it does
nothing.

    RLFERRY_STAMPS=/tmp/st PYTHONPATH=benchmarks/_stamps rlferry demo --device cuda ...
    python benchmarks/_demo_stamps.py /tmp/st
"""

import os
import sys

if os.environ.get("RLFERRY_STAMPS"):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _demo_stamps

    _demo_stamps.install(os.environ["RLFERRY_STAMPS"])
