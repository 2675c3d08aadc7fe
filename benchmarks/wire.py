"""Wire benchmark (see rlferry.bench.wire): python benchmarks/wire.py [--repeat N]."""

import os
import sys

# benchmarks/queue.py is named like the stdlib module `queue`: keep this folder off the path.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

from rlferry.bench.wire import main  # noqa: E402

if __name__ == "__main__":
    main()
