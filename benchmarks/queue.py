"""Queue benchmark (see rlferry.bench.queue).

python benchmarks/queue.py [--iterations N] [--tq-python PATH]
"""

import os
import sys

# This file is named like the stdlib module `queue`: keep its folder off the import path.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

from rlferry.bench.queue import main  # noqa: E402

if __name__ == "__main__":
    main()
