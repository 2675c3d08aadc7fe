"""Weights benchmark (see rlferry.bench.weights).

python benchmarks/weights.py [--transport shm|cuda_ipc|broadcast] [--model qwen3-8b,qwen3-30b-a3b]
"""

import os
import sys

# This folder holds a queue.py that would shadow the stdlib module: keep it off the import path.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

from rlferry.bench.weights import main  # noqa: E402

if __name__ == "__main__":
    main()
