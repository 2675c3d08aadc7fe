"""The ``rlferry`` command: ``rlferry --version``, ``rlferry bench NAME``."""

from __future__ import annotations

import argparse
import importlib

from . import __version__

BENCHES = ("wire",)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="rlferry", description="The data plane of asynchronous RL.")
    p.add_argument("--version", action="version", version=f"rlferry {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark and print its table")
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    a = p.parse_args(argv)
    if a.command == "bench":
        importlib.import_module(f"rlferry.bench.{a.name}").main(a.args)


if __name__ == "__main__":
    main()
