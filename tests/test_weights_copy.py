"""GroupedCopy and ParamLoader: one launch per bucket on CUDA, torch's copies elsewhere.

The CPU tests run in CI (the fallback, the errors, the chunk table, the loader's
cache); the CUDA tests run on the device machine and are skipped on CPU.
"""

import gc

import pytest
import torch

from conftest import requires_cuda
from rlferry.weights import ParamLoader, WeightReceiver, WeightSender
from rlferry.weights.copies import GroupedCopy
from rlferry.weights.copies._copy import (
    CHUNK_BYTES,
    _inner,
    _offsets,
    chunk_table,
    triton_available,
)
from rlferry.weights.copies._pack import BucketItems, Packer, Unpacker, bucketed
from rlferry.weights.planning import TensorSpec
from rlferry.weights.planning._buckets import Plan

requires_triton = pytest.mark.skipif(
    not triton_available(), reason="needs Triton (on the GPU image; optional elsewhere)"
)

# -- on the CPU: what CI checks ------------------------------------------------------------


def test_on_the_cpu_plain_pairs_are_copied_as_bytes_the_others_by_torch():
    big = torch.randn(3 << 20)  # 12 MB: the bulk copy's threads share it
    src = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(4, 4).t(), big]
    dst = [torch.zeros(3, 5), torch.zeros(7, dtype=torch.int64), torch.zeros(4, 4),
           torch.zeros_like(big)]  # fmt: skip
    c = GroupedCopy(dst, src)
    c()
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    assert (c.fused, c.host, c.fallback) == (0, 3, 1)
    assert c.why == "1 pairs by torch: the first (2): not contiguous"


def test_a_copy_built_once_copies_the_current_values_each_call():
    src, dst = [torch.zeros(8)], [torch.empty(8)]
    c = GroupedCopy(dst, src)
    for v in (1.0, 2.0):
        src[0].fill_(v)
        c()
        assert torch.equal(dst[0], torch.full((8,), v))


def test_a_dtype_is_converted_as_copy_does():
    src, dst = [torch.tensor([1.5, -2.25])], [torch.zeros(2, dtype=torch.bfloat16)]
    GroupedCopy(dst, src)()
    assert dst[0].tolist() == [1.5, -2.25]


def test_a_shape_that_differs_is_refused_naming_the_tensor():
    with pytest.raises(ValueError) as e:
        GroupedCopy([torch.zeros(2, 3), torch.zeros(768, 2048)],
                    [torch.zeros(2, 3), torch.zeros(2048, 768)],
                    names=["a", "experts.0.down_proj.weight"])  # fmt: skip
    assert str(e.value) == (
        "GroupedCopy: tensor `experts.0.down_proj.weight`: expected shape (768, 2048) "
        "(the destination's), got (2048, 768)"
    )


def test_without_names_a_tensor_is_named_by_its_position():
    with pytest.raises(ValueError) as e:
        GroupedCopy([torch.zeros(2), torch.zeros(3)], [torch.zeros(2), torch.zeros(4)])
    assert str(e.value) == (
        "GroupedCopy: tensor `#1`: expected shape (3,) (the destination's), got (4,)"
    )


def test_a_count_that_differs_is_refused():
    with pytest.raises(ValueError) as e:
        GroupedCopy([torch.zeros(2)] * 3, [torch.zeros(2)] * 2)
    assert str(e.value) == "GroupedCopy: expected as many sources as destinations (3), got 2"


def test_something_else_than_a_tensor_is_refused_naming_it():
    with pytest.raises(TypeError) as e:
        GroupedCopy([torch.zeros(2)], [[0.0, 1.0]], names=["norm"])  # type: ignore[list-item]
    assert str(e.value) == (
        "GroupedCopy: tensor `norm`: expected a torch.Tensor as source, got list"
    )


def test_the_chunk_table_covers_each_pair_in_order_in_pieces_of_at_most_a_chunk():
    chunk = 1024
    t = chunk_table([10_000, 50_000], [90_000, 70_000], [2560, 16], chunk)
    assert t.tolist() == [
        [10_000, 90_000, 256],
        [11_024, 91_024, 256],
        [12_048, 92_048, 128],
        [50_000, 70_000, 4],
    ]
    assert chunk_table([], [], []).shape == (0, 3)
    assert CHUNK_BYTES % 16 == 0


def test_param_loader_builds_one_copy_per_bucket_and_reuses_it_while_the_list_lives():
    params = {"a": torch.zeros(4), "b": torch.zeros(2, 2)}
    loader = ParamLoader(params)
    items = BucketItems([("a", torch.ones(4)), ("b", torch.full((2, 2), 3.0))])
    for _ in range(3):
        loader(items)
    assert (loader.built, loader.cached) == (1, 1)
    assert torch.equal(params["b"], torch.full((2, 2), 3.0))
    del items
    gc.collect()
    assert loader.cached == 0  # the copy went with rlferry's list


def test_param_loader_copies_a_plain_list_without_keeping_a_copy():
    params = {"a": torch.zeros(4)}
    loader = ParamLoader(params)
    loader([("a", torch.ones(4))])
    loader([("a", torch.full((4,), 2.0))])
    assert (loader.built, loader.cached) == (2, 0)
    assert torch.equal(params["a"], torch.full((4,), 2.0))


def test_param_loader_refuses_a_name_the_engine_does_not_have():
    loader = ParamLoader({"a": torch.zeros(4)})
    with pytest.raises(ValueError) as e:
        loader(
            BucketItems([("a", torch.ones(4)), ("lm_head", torch.ones(2)), ("x", torch.ones(1))])
        )
    assert str(e.value) == (
        "ParamLoader: tensor `lm_head` and 1 more: not a parameter of this engine "
        "(expected one of its 1 names)"
    )


def test_param_loader_as_a_receivers_load_builds_each_bucket_once_over_three_pushes():
    sd = {f"w{i}": torch.randn(64, 256) for i in range(8)}  # 64 KiB each
    params = {n: torch.zeros_like(t) for n, t in sd.items()}
    loader = ParamLoader(params)
    s = WeightSender(group="copy", transport="shm", receivers=1, bucket_bytes=128 << 10)
    r = WeightReceiver(group="copy", address=s.address, load=loader).start()
    try:
        for v in (1, 2, 3):
            for t in sd.values():
                t.add_(1)
            report = s.push(sd.items(), version=v, timeout=60)
            assert r.wait_for(v, 30)
            assert all(torch.equal(params[n], t) for n, t in sd.items())
        assert loader.built == report.buckets == 4
    finally:
        r.close()
        s.close()


# -- on CUDA: the kernel ------------------------------------------------------------------


def _poisoned(ts):
    return [torch.full_like(t, 7) for t in ts]


@requires_cuda
@requires_triton
def test_on_cuda_one_launch_copies_every_pair_exactly_as_copy_does():
    g = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(768, 2048), (2048, 768), (128,), (151936 // 16, 2048), (3, 1000), (17, 64)]
    src = [torch.randn(s, device="cuda", generator=g).bfloat16() for s in shapes]
    src.append(torch.randint(0, 255, (5 * CHUNK_BYTES + 48,), device="cuda", dtype=torch.uint8))
    dst = _poisoned(src)
    c = GroupedCopy(dst, src)
    assert (c.fused, c.fallback, c.why) == (len(src), 0, "")
    c()
    torch.cuda.synchronize()
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    for s in src:  # again, with new values: the table stays valid
        s.copy_(torch.rand(s.shape, device="cuda").mul(100).to(s.dtype))
    c()
    torch.cuda.synchronize()
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))


@requires_cuda
@requires_triton
@pytest.mark.parametrize("programs", [1, 7, 64])
def test_on_cuda_a_bounded_grid_copies_every_pair_exactly(programs):
    src = [torch.randn(s, device="cuda") for s in [(300, 1024), (4,), (3 * CHUNK_BYTES // 4 + 4,)]]
    dst = _poisoned(src)
    c = GroupedCopy(dst, src, programs=programs)
    c()
    torch.cuda.synchronize()
    assert c.fused == 3 and all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))


def test_a_grid_of_no_program_is_refused():
    with pytest.raises(ValueError) as e:
        GroupedCopy([torch.zeros(2)], [torch.zeros(2)], programs=0)
    assert str(e.value) == "GroupedCopy.programs: expected None or >= 1, got 0"


@requires_cuda
@requires_triton
def test_on_cuda_pairs_the_kernel_does_not_take_fall_back_in_the_same_call():
    base = torch.randn(4097, device="cuda")
    src = [
        torch.randn(256, device="cuda"),  # fused
        torch.randn(64, 32, device="cuda").t(),  # strided
        base[1:257],  # 4-byte aligned only
        torch.randn(10, device="cuda").half(),  # a dtype to convert
        torch.randn(3, device="cuda"),  # 12 bytes: not a multiple of 16
    ]
    dst = [torch.zeros(256, device="cuda"), torch.zeros(32, 64, device="cuda"),
           torch.zeros(256, device="cuda"), torch.zeros(10, device="cuda"),
           torch.zeros(3, device="cuda")]  # fmt: skip
    c = GroupedCopy(dst, src)
    assert (c.fused, c.fallback) == (1, 4)
    assert c.why == (
        "4 pairs by torch: the first (1): strided, in runs of 4 bytes (not a multiple of 16) "
        "(and 3 more)"
    )
    c()
    torch.cuda.synchronize()
    assert all(torch.equal(d, s.to(d.dtype)) for d, s in zip(dst, src, strict=True))


def test_a_strided_view_is_taken_as_its_runs_of_contiguous_elements_in_order():
    t = torch.arange(6 * 8).reshape(6, 8)
    cols = t[:, 2:6]  # a trainer rank's columns of a row-parallel weight
    assert _inner(cols) == 4 and _inner(t) == 48 and _inner(t.t()) == 1
    assert _offsets(cols, 4).tolist() == [0, 8, 16, 24, 32, 40]
    assert _offsets(t, 48).tolist() == [0]
    cube = torch.arange(4 * 3 * 8).reshape(4, 3, 8)[1:3, :, 4:]  # runs of 4, two outer dims
    offs = _offsets(cube, 4)
    flat = cube.reshape(-1).tolist()
    assert [cube.flatten()[0].item() + o for o in offs.tolist()] == flat[::4]
    one = torch.arange(16).reshape(4, 1, 4)[:, :, :2]  # a size-1 dim between
    assert _inner(one) == 2 and _offsets(one, 2).tolist() == [0, 4, 8, 12]


@requires_cuda
@requires_triton
@pytest.mark.parametrize("programs", [None, 64])
def test_on_cuda_strided_views_are_copied_by_the_kernel_in_runs(programs):
    g = torch.Generator(device="cuda").manual_seed(2)
    shard = torch.randn(1024, 6144, device="cuda", generator=g).bfloat16()  # a down_proj's rows
    big = torch.zeros(2048, 4096, device="cuda", dtype=torch.bfloat16)
    cube = torch.randn(8, 64, 512, device="cuda", generator=g)
    wide = torch.randn(16384, 1024, device="cuda", generator=g).bfloat16()
    src = [
        shard[:, 3072:],  # columns of a row shard, into a contiguous piece
        torch.randn(1024, 2048, device="cuda", generator=g).bfloat16(),  # into columns
        cube[2:6, :, 256:],  # runs of 1 KiB over two outer dims
        torch.randn(4096, device="cuda", generator=g),  # contiguous, beside them
        shard[:128, 8:72],  # runs of 128 bytes in 16 KiB: a table row each all the same
        wide[:, :64],  # runs of 128 bytes in 2 MiB: too short, torch copies it
    ]
    dst = [torch.full((1024, 3072), 7.0, device="cuda", dtype=torch.bfloat16), big[1024:, 2048:],
           torch.zeros(4, 64, 256, device="cuda"), torch.zeros(4096, device="cuda"),
           torch.zeros(128, 64, device="cuda", dtype=torch.bfloat16),
           torch.zeros(16384, 64, device="cuda", dtype=torch.bfloat16)]  # fmt: skip
    c = GroupedCopy(dst, src, programs=programs)
    assert (c.fused, c.strided, c.fallback) == (5, 4, 1)
    assert c.why == (
        "1 pairs by torch: the first (5): strided, in runs of 128 bytes (under 512, over "
        "1048576 bytes)"
    )
    for _ in range(2):  # new values the second time: the table of runs stays valid
        c()
        torch.cuda.synchronize()
        assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
        assert big[:1024].count_nonzero() == 0 and big[1024:, :2048].count_nonzero() == 0
        for s in src:
            s.copy_(torch.rand(s.shape, device="cuda", generator=g).mul(100).to(s.dtype))


@requires_cuda
@requires_triton
def test_on_cuda_the_copy_runs_on_the_current_stream():
    src = [torch.randn(1 << 20, device="cuda") for _ in range(4)]
    dst = [torch.zeros_like(t) for t in src]
    c = GroupedCopy(dst, src)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        c()
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))


class _Buffers:  # what a Packer packs into
    generation = 0
    collective = False

    def __init__(self, nbytes):
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]

    def buffer(self, b):
        return self.bufs[b]


@requires_cuda
@requires_triton
def test_the_packer_uses_one_grouped_copy_once_the_same_tensors_come_again():
    sd = {f"w{i}": torch.randn(256, 1024, device="cuda") for i in range(6)}  # 1 MiB each
    plan = Plan.build([TensorSpec(n, tuple(t.shape), t.dtype) for n, t in sd.items()], 2 << 20)
    tr = _Buffers(plan.buffer_bytes)
    packer, unpacker = Packer(plan, tr, torch.device("cuda")), Unpacker(plan, tr.bufs)
    for push in range(3):
        for t in sd.values():
            t.add_(1)
        for k, tensors in bucketed(plan, sd.items(), False):
            packer.pack(k, tensors)
            torch.cuda.synchronize()
            assert all(torch.equal(v, sd[n]) for n, v in unpacker.loads[k])
        built = [c is not None for c in packer._copies]
        assert built == [push > 0] * plan.buckets  # built on the second push, then reused


@requires_cuda
@requires_triton
def test_the_copy_kernels_are_loaded_once_and_any_row_count_reuses_them():
    # a kernel loaded while an NCCL receive runs can wait for it (and hang the update):
    # a link loads them before its group forms, and no later table needs another
    from rlferry.weights.copies._copy import load_kernels
    from rlferry.weights.copies._copy_kernel import _copy_rows, _copy_tiles

    dev = torch.cuda.current_device()
    load_kernels(torch.device("cuda"))
    caches = [len(fn.device_caches[dev][0]) for fn in (_copy_rows, _copy_tiles)]
    assert caches == [1, 1]
    for n in (1, 16, 17, 48):  # tables of 1, 16, 17 and 48 rows
        src = [torch.randn(64, 64, device="cuda").t() for _ in range(n)]  # strided: bounded grid
        dst = [torch.empty(64, 64, device="cuda") for _ in range(n)]
        copy = GroupedCopy([d.t() for d in dst], src, programs=4)
        copy()
        torch.cuda.synchronize()
        assert all(torch.equal(d.t(), s) for d, s in zip(dst, src, strict=True))
    assert [len(fn.device_caches[dev][0]) for fn in (_copy_rows, _copy_tiles)] == caches
