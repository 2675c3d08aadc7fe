"""Rename the fixtures of TransferQueue's test modules that start Ray or read its controller
actor, so that the fixtures of the same names in our conftest apply (a test module's own
fixture would shadow them). Only fixture definitions are renamed; no test is edited."""

import re
import sys
from pathlib import Path

FIXTURES = ("ray_init", "ray_cluster", "controller", "cleanup_partition")

for path in Path(sys.argv[1]).rglob("test_*.py"):
    text = path.read_text()
    new = re.sub(rf"^def ({'|'.join(FIXTURES)})\(", r"def _upstream_\1(", text, flags=re.M)
    if new != text:
        path.write_text(new)
