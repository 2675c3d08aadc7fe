"""Wire benchmark (see rlferry.bench.wire): python benchmarks/wire.py [--repeat N]."""

from rlferry.bench.wire import main

if __name__ == "__main__":
    main()
