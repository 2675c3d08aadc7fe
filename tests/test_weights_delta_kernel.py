"""The Triton kernels of the CUDA diff and apply, bit for bit against the CPU diff and
``index_copy_``: on the CPU through Triton's interpreter (small tensors; skipped without
Triton), on CUDA by tests/test_weights_delta_gpu.py with larger ones."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlferry.weights.delta import Delta
from rlferry.weights.delta._device_diff import encode_by_kernels
from rlferry.weights.delta._encoding import Encoded, _encode_on_host

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SMALL = [((300,), torch.bfloat16, 0.05), ((3, 7), torch.bfloat16, 0.3),
         ((1000, 9), torch.float32, 0.02), ((513,), torch.float16, 0.0),
         ((700,), torch.float64, 0.01), ((2, 260), torch.bfloat16, 0.95),
         ((64,), torch.float8_e4m3fn, 0.1), ((5000,), torch.bfloat16, 0.2)]  # fmt: skip


def pair(shape, dtype, frac, g):
    """A base and a new version with ``frac`` of its elements one bit apart."""
    base = torch.randn(shape, generator=g).to(dtype)
    ints = base.view(-1).view(INTS[base.element_size()])
    step = (torch.rand(ints.shape, generator=g) < frac).to(ints.dtype)
    return base, (ints ^ step).view(dtype).view(shape)


def check(cases, device, host_base=False, encoder=encode_by_kernels):
    """The kernels' diff of ``cases`` on ``device`` (bases there, or in host memory)
    against the CPU diff: the same records, counts and bases; each record applied by the
    kernel rebuilds the new version. ``encoder``: the diff checked."""
    g = torch.Generator().manual_seed(0)
    pairs = [pair(*c, g) for c in cases]
    where = "cpu" if host_base else device
    entries = [(f"t{i}", n.to(device), b.to(where, copy=True)) for i, (b, n) in enumerate(pairs)]
    entries.append(("dense", torch.ones(4, device=device), None))
    got = Encoded()
    encoder(entries, got)
    want = Encoded()
    for i, (b, n) in enumerate(pairs):
        _encode_on_host(f"t{i}", n, b.clone(), [], want)
    want.add("dense", torch.ones(4))
    assert got.sparse == want.sparse
    assert (got.compared, got.changed, got.sent) == (want.compared, want.changed, want.sent)
    assert [n for n, _ in got.pushed] == [n for n, _ in want.pushed]
    for (name, a), (_, b) in zip(got.pushed, want.pushed, strict=True):
        assert torch.equal(a.cpu().view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), name
    for (name, _, kept), (_, n) in zip(entries, pairs, strict=False):
        assert torch.equal(kept.cpu().view(torch.uint8), n.view(torch.uint8)), name
    records = {n: (s, dt, c) for n, s, dt, c in got.sparse}
    for name, data in got.pushed:
        if name.removesuffix("\x00delta") in records:
            i = int(name.removesuffix("\x00delta")[1:])
            base, new = pairs[i]
            shape, dtype, changed = records[name.removesuffix("\x00delta")]
            t = base.to(device, copy=True)
            Delta.from_bytes(data, shape, dtype, changed).apply_(t)
            assert torch.equal(t.cpu().view(torch.uint8), new.view(torch.uint8)), name


def _interpreted():
    from rlferry.weights.delta import _record

    _record.kernels = lambda device: True  # the kernel apply on the CPU, interpreted
    check(SMALL, "cpu")
    print("interpreted: same bytes")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_kernels_make_the_cpu_diffs_bytes_in_tritons_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *sys.path])
    code = "import test_weights_delta_kernel as t; t._interpreted()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "interpreted: same bytes" in r.stdout
