"""The CPU diff and apply of the C extension (``_fastdiff``) against the torch ops, bit for
bit: every element size, sizes around a block, 0% to 100% changed, the sparse-or-dense
threshold to the element, strided inputs, runs past the scratch, malformed deltas."""

import pytest
import torch

from rlferry.weights.delta import Delta, _encoding, _native, _record
from rlferry.weights.delta._encoding import encode, most_sparse
from rlferry.weights.delta._record import BLOCK, layout

fastdiff = pytest.importorskip(
    "rlferry.weights.delta._fastdiff", reason="built at install only where a C compiler is"
)

DTYPES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64]
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SIZES = [0, 1, 255, 256, 257, 3 * BLOCK + 17, 600 * BLOCK + 5]  # the last is cut in two


def changed(old: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    """``old`` with ``frac`` of its elements one bit apart."""
    g = torch.Generator().manual_seed(seed)
    new = old.clone()
    flat = new.view(-1).view(INTS[old.element_size()])
    flat ^= (torch.rand(flat.shape, generator=g) < frac).to(flat.dtype)
    return new


def random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(-(2**15), 2**15, (*shape, size // 2 or 1), generator=g)
    return raw.to(torch.int16).view(torch.uint8)[..., :size].contiguous().view(dtype).squeeze(-1)


class Plain:
    """The extension with its plain C kernels (the CPU's vector ones are the default)."""

    @staticmethod
    def diff(jobs, threads):
        return fastdiff.diff(jobs, threads, True)


def both(entries, monkeypatch, plain=False):
    """``encode`` with the extension and with torch ops, each on its own copy of the bases:
    (encoded, bases) for each."""
    out = []
    for native in (True, False):
        with monkeypatch.context() as m:
            m.setattr(_encoding, "fastdiff", (Plain if plain else fastdiff) if native else None)
            bases = [None if b is None else b.clone() for _, _, b in entries]
            got = encode([(n, t, b) for (n, t, _), b in zip(entries, bases, strict=True)], [])
            out.append((got, bases))
    return out


def assert_same(entries, monkeypatch, plain=False):
    (a, abases), (b, bbases) = both(entries, monkeypatch, plain)
    assert [n for n, _ in a.pushed] == [n for n, _ in b.pushed]
    for (_, x), (_, y) in zip(a.pushed, b.pushed, strict=True):
        assert x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8),
                                                  y.reshape(-1).view(torch.uint8))  # fmt: skip
    assert (a.sparse, a.compared, a.changed, a.sent) == (b.sparse, b.compared, b.changed, b.sent)
    for (_, new, _), x, y in zip(entries, abases, bbases, strict=True):
        if x is not None:
            assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
            assert torch.equal(x.view(-1).view(torch.uint8),
                               new.contiguous().view(-1).view(torch.uint8))  # fmt: skip
    return a


@pytest.mark.parametrize("plain", [False, True], ids=["vector", "plain"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.5, 1.0])
def test_the_native_diff_encodes_the_bytes_of_the_torch_diff(dtype, frac, plain, monkeypatch):
    entries = []
    for i, numel in enumerate(SIZES):
        old = random((numel,), dtype, i)
        entries.append((f"t{i}", changed(old, frac, 100 + i), old))
    got = assert_same(entries, monkeypatch, plain)
    assert got.compared == sum(SIZES)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("numel", [1, 257, 600 * BLOCK + 5])
def test_the_sparse_or_dense_choice_is_exact_at_the_threshold(dtype, numel, monkeypatch):
    size = torch.empty((), dtype=dtype).element_size()
    most = most_sparse(numel, size)
    assert layout(numel, most + 1, size)[3] > 0.9 * numel * size
    assert most == 0 or layout(numel, most, size)[3] <= 0.9 * numel * size
    old = random((numel,), dtype, numel)
    for n in {most - 1, most, most + 1} - {-1}:
        if n == 0 or n > numel:
            continue
        new = old.clone()
        idx = torch.randperm(numel, generator=torch.Generator().manual_seed(n))[:n]
        new.view(INTS[size])[idx] ^= 1
        got = assert_same([("t", new, old)], monkeypatch)
        assert got.changed == n and len(got.sparse) == (1 if n <= most else 0)


def test_strided_tensors_without_bases_and_runs_past_the_scratch(monkeypatch):
    monkeypatch.setattr(_encoding, "SCRATCH_BYTES", 4096)
    entries = []
    for i in range(6):
        old = random((300, 200), torch.bfloat16, i)
        new = changed(old.t().contiguous(), 0.02, i).t()  # a strided view of the new version
        entries.append((f"s{i}", new, old if i != 2 else None))
    entries.append(("w", changed(random((4000,), torch.float32, 9), 0.3, 9), None))
    got = assert_same(entries, monkeypatch)
    assert [n for n, *_ in got.sparse] == ["s0", "s1", "s3", "s4", "s5"]


def test_the_signed_zeros_and_nan_payloads_differ_as_bits(monkeypatch):
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0] * 300)
    new = old.clone()
    new[0] = -0.0
    new.view(torch.int32)[2] ^= 1
    assert assert_same([("t", new, old)], monkeypatch).changed == 2


def delta_of(old: torch.Tensor, new: torch.Tensor) -> Delta:
    """The delta from ``old`` to ``new`` (sparse whatever it costs)."""
    ints = INTS[old.element_size()]
    idx = torch.ne(old.view(ints), new.view(ints)).nonzero().squeeze(1)
    counts = torch.bincount(idx >> 8, minlength=-(-old.numel() // BLOCK)).to(torch.int16)
    offsets = (idx & (BLOCK - 1)).to(torch.uint8)
    return Delta(counts, offsets, new[idx], tuple(old.shape), old.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 257, 3 * BLOCK + 17, 600 * BLOCK + 5])
def test_the_native_apply_writes_what_index_copy_writes(dtype, numel, monkeypatch):
    old = random((numel,), dtype, numel)
    new = changed(old, 0.05, numel)
    new.view(-1).view(INTS[new.element_size()])[-1] ^= 2  # the last element, in a short block
    delta = delta_of(old, new)
    got = delta.apply_(old.clone())
    with monkeypatch.context() as m:
        m.setattr(_record, "fastdiff", None)
        ref = delta.apply_(old.clone())
    assert torch.equal(got.view(torch.uint8), new.view(torch.uint8))
    assert torch.equal(ref.view(torch.uint8), new.view(torch.uint8))


def test_a_delta_that_does_not_fit_its_tensor_is_left_to_torch_untouched():
    t = torch.zeros(600)
    counts = torch.tensor([2, 0, 1], dtype=torch.int16)
    past = Delta(counts, torch.tensor([3, 255, 90], dtype=torch.uint8),
                 torch.tensor([1.0, 2.0, 3.0]), (600,), torch.float32)  # fmt: skip
    flat = t.view(torch.int32)
    assert not fastdiff.apply(flat.data_ptr(), 600, 4, counts.data_ptr(),
                              past.offsets.data_ptr(), past.values.data_ptr(), 3, 2)  # fmt: skip
    assert not fastdiff.apply(flat.data_ptr(), 600, 4, counts.data_ptr(),
                              past.offsets.data_ptr(), past.values.data_ptr(), 4, 2)  # fmt: skip
    assert not t.any()
    with pytest.raises(IndexError, match="out of bounds"):  # as torch refuses it
        past.apply_(t)


def test_without_the_extension_the_threads_and_module_are_optional():
    assert _native.THREADS >= 1
    assert _native.fastdiff is fastdiff
