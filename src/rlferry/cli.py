"""The ``rlferry`` command: ``rlferry --version``, ``rlferry bench NAME``."""

from __future__ import annotations

import argparse
import importlib

from . import __version__

BENCHES = (
    "queue",
    "weights",
    "wire",
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="rlferry", description="The data plane of asynchronous RL.")
    p.add_argument("--version", action="version", version=f"rlferry {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark and print its table")
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    serve = sub.add_parser("serve", help="run services that clients connect to by address")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    sq = serve_sub.add_parser("queue", help="a queue: controller + storage units (processes)")
    sq.add_argument("--storage-units", type=int, default=2)
    sq.add_argument(
        "--bind",
        default=None,
        help="controller address (default: a new ipc:// path; off loopback needs --secret)",
    )
    sq.add_argument("--secret", default=None, help="shared secret (CURVE) for remote binds")
    sq.add_argument("--tasks", default="train", help="comma-separated task names")
    sq.add_argument("--capacity", type=int, default=None)
    sq.add_argument("--max-partitions", type=int, default=None)
    sq.add_argument("--lease-timeout", type=float, default=60.0)
    a = p.parse_args(argv)
    if a.command == "serve":
        from rlferry.queue._serve import serve_queue

        serve_queue(
            storage_units=a.storage_units,
            bind=a.bind,
            secret=a.secret,
            tasks=tuple(a.tasks.split(",")),
            capacity=a.capacity,
            max_partitions=a.max_partitions,
            lease_timeout=a.lease_timeout,
        )
    if a.command == "bench":
        importlib.import_module(f"rlferry.bench.{a.name}").main(a.args)


if __name__ == "__main__":
    main()
