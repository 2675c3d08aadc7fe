"""The wire's shared-memory copies: every byte lands, whatever the layout."""

from __future__ import annotations

import torch

from rlferry.wire import shared_copies
from rlferry.wire.memory._copies import copy_many, side_by_side
from rlferry.wire.memory._segments import AVAILABLE, exports


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


def test_views_of_one_shared_storage_travel_as_one_frame() -> None:
    from rlferry.wire import decode, encode, shared_empty

    flat = shared_empty([8 << 20], torch.uint8)
    value = {
        "a": flat[: 4 << 20].view(torch.float32).view(1024, 1024),
        "b": flat[4 << 20 : 6 << 20].view(torch.bfloat16),
        "c": flat[6 << 20 :].view(torch.int64)[1:],  # not at the storage's start
        "own": torch.ones(3),
    }
    value["a"].normal_()
    value["b"].fill_(1.5)  # no NaN from the pool's old bytes: torch.equal(nan, nan) is False
    value["c"].random_()
    frames = encode(value, shared=True)
    assert len(frames) == (3 if AVAILABLE else 5)  # header, the storage, "own"
    out = decode(frames)
    for name, t in value.items():
        assert torch.equal(out[name], t) and out[name].dtype == t.dtype
    assert len(encode(value)) == 5  # without shared memory: one frame per tensor
    columns = {k: value[k] for k in ("a", "b", "c")}  # one storage: one node, one frame
    frames = encode(columns, shared=True)
    assert len(frames) == (2 if AVAILABLE else 4)
    assert all(torch.equal(decode(frames)[k], t) for k, t in columns.items())


def test_streaming_copy_any_alignment_and_length() -> None:
    import pytest

    fastcopy = pytest.importorskip(
        "rlferry.wire._fastcopy", reason="built at install only where a C compiler is"
    )
    src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
    for d, s, n in [(0, 0, 0), (1, 3, 5), (7, 0, 63), (3, 5, 64), (13, 1, 1000), (5, 9, 1 << 19)]:
        dst = torch.zeros(n + 32, dtype=torch.uint8)
        fastcopy.copy(dst.data_ptr() + d, src.data_ptr() + s, n)
        assert torch.equal(dst[d : d + n], src[s : s + n])
        assert not dst[:d].any() and not dst[d + n :].any()  # nothing written outside


def test_large_string_columns_come_back_exact_ascii_utf8_and_bytes() -> None:
    import os

    from rlferry.wire import pack_strings

    ascii_text = [os.urandom(int(n)).hex() for n in torch.randint(0, 900, (3000,))]
    utf8 = [*ascii_text[:1500], "naïve " * 200, *ascii_text[1500:]]  # one non-ASCII item
    raw = [os.urandom(int(n)) for n in torch.randint(0, 1800, (1500,))]
    for items in (ascii_text, utf8, raw, ["", "x" * (2 << 20), ""]):
        packed = pack_strings(items)
        assert packed is not None
        out = packed.tolist()
        assert out == items
        assert all(type(a) is type(b) for a, b in zip(out, items, strict=True))
    assert {pack_strings(ascii_text).tolist()[7]: 1}[ascii_text[7]] == 1  # hashes like a str


def test_fill_strings_refuses_items_that_do_not_match_their_bounds() -> None:
    import pytest

    fastcopy = pytest.importorskip(
        "rlferry.wire._fastcopy", reason="built at install only where a C compiler is"
    )
    data = torch.frombuffer(bytearray(b"hello world"), dtype=torch.uint8)
    items = fastcopy.empty_strings([0, 3], True)
    with pytest.raises(ValueError, match="an item's length differs from its bounds"):
        fastcopy.fill_strings(items, 0, 1, data.data_ptr(), [0, 5])
    with pytest.raises(ValueError, match="bad range or bounds"):
        fastcopy.fill_strings(items, 0, 2, data.data_ptr(), [0, 3])


def test_bulk_copies_from_several_threads_at_once_all_land() -> None:
    from concurrent.futures import ThreadPoolExecutor

    sources = [torch.randint(0, 255, (16 << 20,), dtype=torch.uint8) for _ in range(4)]
    targets = [torch.zeros_like(s) for s in sources]

    def one(i: int) -> bool:
        copy_many([(targets[i].data_ptr(), sources[i].data_ptr(), sources[i].numel())])
        sums = side_by_side([lambda: int(sources[i][:99].sum()), lambda: i])
        return sums == [int(sources[i][:99].sum()), i]

    with ThreadPoolExecutor(4) as pool:  # more callers than helper threads
        assert all(pool.map(one, range(4)))
    assert all(torch.equal(s, t) for s, t in zip(sources, targets, strict=True))


def _copy_in_child(conn) -> None:  # type: ignore[no-untyped-def]
    import ctypes
    import os

    # no torch here: its OpenMP pool does not survive a fork (a torch matter, not ours)
    src = ctypes.create_string_buffer(os.urandom(24 << 20), 24 << 20)
    dst = ctypes.create_string_buffer(24 << 20)
    copy_many([(ctypes.addressof(dst), ctypes.addressof(src), 24 << 20)])  # helpers did not fork
    conn.send(dst.raw == src.raw and side_by_side([lambda: 1, lambda: 2]) == [1, 2])


def test_bulk_copy_in_a_forked_child_does_not_wait_for_helpers_that_are_not_there() -> None:
    import multiprocessing as mp

    src = torch.ones(16 << 20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copy_many([(dst.data_ptr(), src.data_ptr(), src.numel())])  # the helpers start
    ctx = mp.get_context("fork")  # as a DataLoader worker is made
    here, there = ctx.Pipe()
    child = ctx.Process(target=_copy_in_child, args=(there,))
    child.start()
    assert here.poll(60), "the child's copy hung"
    assert here.recv() is True
    child.join(10)


def test_a_forked_child_never_reuses_its_parents_shared_memory() -> None:
    """The parent's segments stay mapped in a forked child, shared with the parent, which
    goes on lending them: a child that wrote into one would write into the parent's sends."""
    import ctypes
    import os

    import pytest

    if not AVAILABLE:
        pytest.skip("no shared memory on this platform")
    from rlferry.wire import shared_empty

    warm = shared_empty([1 << 20], torch.uint8)
    base = warm.data_ptr()
    ctypes.memset(base, 7, 1 << 20)
    del warm  # back to the parent's free pool
    assert exports.find(base, 1 << 20) is not None
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        # the child forgets the parent's segments (it may unmap them, and a segment of its
        # own may then land at the same address: its own memory, never the parent's)
        fresh = shared_empty([1 << 20], torch.uint8)
        ctypes.memset(fresh.data_ptr(), 9, 1 << 20)  # no torch op: its threads do not fork
        os.write(write, b"1")
        os._exit(0)
    os.close(write)
    told = os.read(read, 1)
    os.waitpid(child, 0)
    assert told == b"1"
    m = exports.find(base, 1 << 20)
    assert m is not None  # the parent still has it, and the child wrote nothing into it
    view = (ctypes.c_char * (1 << 20)).from_address(base)
    assert bytes(view) == bytes([7]) * (1 << 20)
