"""The wire's shared-memory copies: every byte lands, whatever the layout."""

from __future__ import annotations

import torch

from rlferry.wire import shared_copies
from rlferry.wire._shm import AVAILABLE, copy_many, exports


def test_shared_copies_equal_their_sources_across_chunks_and_layouts() -> None:
    big = torch.randn(3, 5 << 20)  # 60 MiB: split in chunks over several threads
    odd = torch.arange(1_000_003, dtype=torch.int16)  # a length no chunk divides
    strided = torch.randn(2048, 512).t()  # not contiguous: copied by torch
    conj = torch.randn(70_000, dtype=torch.complex64).conj()  # a lazy view, resolved
    small = torch.ones(10)  # below the bulk size: left where it is
    out = shared_copies([big, odd, strided, conj, small])
    for src, dst in zip([big, odd, strided, conj, small], out, strict=True):
        assert torch.equal(src, dst) and dst.shape == src.shape and dst.dtype == src.dtype
    assert out[4] is small
    if AVAILABLE:
        for t in out[:4]:
            assert exports.find(t.data_ptr(), t.numel() * t.element_size()) is not None


def test_copy_many_copies_many_small_ranges() -> None:
    src = torch.randint(0, 255, (12 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    step = 3 << 10  # 4096 ranges of 3 KiB: grouped into tasks of a few MiB
    jobs = [(dst.data_ptr() + a, src.data_ptr() + a, step) for a in range(0, src.numel(), step)]
    copy_many(jobs)
    assert torch.equal(src, dst)
