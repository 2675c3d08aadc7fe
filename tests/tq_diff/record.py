"""Record what the real `transferqueue==0.1.11` answers to every scenario: `golden.json`.

Run in a venv of its own (TransferQueue pins Ray and tensordict versions of its own):

    python3 -m venv .venv-tq
    .venv-tq/bin/pip install torch==2.13.0 transferqueue==0.1.11
    .venv-tq/bin/python tests/tq_diff/record.py

It starts a local Ray (`num_cpus=16`: TransferQueue's controller and each storage unit ask for
one CPU, and would not be scheduled on a 2-core machine otherwise), runs every scenario of
`scenarios.py` on `transfer_queue`, and writes `tests/tq_diff/golden.json`. About two minutes
on a 2-core machine. `--only NAME` runs the named scenarios and prints their records instead;
`--check` runs them all and compares with `golden.json` the way the differential test does (a
second run of the real package must match the first: that shows the records leave out what
TransferQueue does not fix, such as the order of concurrent puts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden.json"
RECORDED_WITH = ("transferqueue", "ray", "tensordict", "torch", "omegaconf")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="run these scenarios and print them"
    )
    parser.add_argument("--check", action="store_true", help="compare with the golden file")
    parser.add_argument(
        "--out", type=Path, default=GOLDEN, help="where to write (default: %(default)s)"
    )
    args = parser.parse_args()

    sys.path.insert(0, str(HERE.parent))
    import ray
    import transfer_queue

    from tq_diff.scenarios import SCENARIOS

    if transfer_queue.__version__ != "0.1.11":
        sys.exit(f"record.py needs transferqueue 0.1.11, found {transfer_queue.__version__}")
    names = args.only or list(SCENARIOS)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        sys.exit(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}")

    # address="local": a Ray of our own, even where another one runs on this machine.
    ray.init(address="local", num_cpus=16, include_dashboard=False)
    results = {}
    try:
        for name in names:
            started = time.monotonic()
            # The JSON round trip makes a record what the comparison will read back.
            results[name] = json.loads(json.dumps(SCENARIOS[name](transfer_queue)))
            print(f"{name}: {time.monotonic() - started:.1f} s", file=sys.stderr)
    finally:
        ray.shutdown()

    if args.only:
        print(json.dumps(results, indent=1, sort_keys=True))
        return
    if args.check:
        from tq_diff.compare import mismatches

        golden = json.loads(args.out.read_text())["scenarios"]
        found = [line for name in names for line in mismatches(golden[name], results[name], name)]
        print("\n".join(found) or f"{len(names)} scenarios match {args.out}")
        sys.exit(1 if found else 0)
    golden = {
        "recorded_with": {dist: metadata.version(dist) for dist in RECORDED_WITH},
        "scenarios": results,
    }
    args.out.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
