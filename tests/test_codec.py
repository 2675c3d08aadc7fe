"""The wire codec: exact round trips, zero-copy decoding, exact refusals."""

import ctypes

import numpy as np
import pytest
import torch

from rlferry.wire import WireError, decode, encode
from rlferry.wire._refs import DTYPES


def roundtrip(value):
    # bytearray frames are writable, as zmq frames received with copy=False are
    return decode([bytearray(memoryview(f).cast("B")) for f in encode(value)])


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips_bit_exact(name):
    dtype = DTYPES[name]
    raw = torch.randint(0, 256, (3, 5 * dtype.itemsize), dtype=torch.uint8)
    t = raw.view(dtype)
    out = roundtrip(t)
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), raw)


def test_zero_dim_empty_and_non_contiguous_tensors_round_trip():
    scalar = torch.tensor(2.5, dtype=torch.bfloat16)
    empty = torch.empty(0, 7, dtype=torch.int64)
    strided = torch.arange(24.0).reshape(4, 6).t()[::2]
    out = roundtrip({"s": scalar, "e": empty, "t": strided})
    assert out["s"].shape == () and out["s"].dtype == torch.bfloat16 and out["s"].item() == 2.5
    assert out["e"].shape == (0, 7) and out["e"].dtype == torch.int64
    assert torch.equal(out["t"], strided)


def test_lazy_conjugate_and_negative_views_travel_as_their_values():
    z = torch.complex(torch.randn(6), torch.randn(6))
    conj = z.conj()  # a view with the conjugate bit: its memory holds z
    neg = torch.randn(5).conj()._neg_view()  # type: ignore[attr-defined]
    assert conj.is_conj() and neg.is_neg()
    assert torch.equal(decode(encode(conj)), conj.resolve_conj())
    assert torch.equal(decode(encode(neg)), neg.resolve_neg())
    ragged = decode(encode([conj, conj[:2]]))
    assert torch.equal(ragged[0], conj.resolve_conj())
    assert torch.equal(ragged[1], conj[:2].resolve_conj())
    both = decode(encode({"a": conj, "b": neg}, shared=True))
    assert torch.equal(both["a"], conj.resolve_conj()) and torch.equal(both["b"], neg.resolve_neg())


def test_list_of_tensors_of_different_lengths_comes_back_as_that_list():
    ragged = [torch.arange(3), torch.arange(5), torch.arange(0), torch.arange(1)]
    frames = encode(ragged)
    assert len(frames) == 2  # packed in one frame, not one per tensor
    out = roundtrip(ragged)
    assert isinstance(out, list) and len(out) == 4
    for a, b in zip(ragged, out, strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype


def test_ragged_rows_of_any_shape_views_and_grad_travel_packed_as_their_values():
    base = torch.arange(40, dtype=torch.float32)
    rows = [
        *base.split([7, 0, 33]),  # views of one tensor, an empty one among them
        torch.randn(2, 3, requires_grad=True),  # a parameter-like row: its values travel
        torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
        torch.zeros(0, 5),
        torch.tensor(2.5),  # 0-d
    ]
    assert len(encode(rows)) == 2  # one packed frame
    out = roundtrip(rows)
    assert [t.shape for t in out] == [t.shape for t in rows]
    for a, b in zip(rows, out, strict=True):
        assert torch.equal(a.detach(), b) and not b.requires_grad


def test_list_of_equal_shape_tensors_is_not_stacked():
    same = [torch.ones(2, 3), torch.zeros(2, 3)]
    out = roundtrip(same)
    assert isinstance(out, list) and [t.shape for t in out] == [(2, 3), (2, 3)]
    assert torch.equal(out[0], same[0]) and torch.equal(out[1], same[1])


def test_jagged_nested_tensor_comes_back_jagged():
    nt = torch.nested.nested_tensor(
        [torch.randn(2, 4), torch.randn(5, 4), torch.randn(1, 4)], layout=torch.jagged
    )
    out = roundtrip(nt)
    assert out.is_nested and out.layout == torch.jagged
    for a, b in zip(nt.unbind(), out.unbind(), strict=True):
        assert torch.equal(a, b)


def test_numpy_arrays_round_trip():
    arrays = [
        np.arange(10, dtype=np.int16).reshape(2, 5),
        np.array(3.5),
        np.zeros((0, 3)),
        np.array([True, False]),
        np.arange(6, dtype=np.complex64)[::2],
    ]
    out = roundtrip(arrays)
    for a, b in zip(arrays, out, strict=True):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)


def test_plain_values_round_trip_with_their_types():
    value = {
        "none": None,
        "bool": True,
        "int": -(2**63),
        "uint": 2**64 - 1,
        "float": 1.5,
        "str": "héllo",
        "bytes": b"\x00\xff",
        "list": [1, [2, (3, "x")]],
        "tuple": (1, None, {"k": (torch.ones(1),)}),
        "empty": {},
        "emptylist": [],
    }
    out = roundtrip(value)
    assert out.keys() == value.keys()
    for k in ("none", "bool", "int", "uint", "float", "str", "bytes", "list", "empty", "emptylist"):
        assert out[k] == value[k] and type(out[k]) is type(value[k])
    assert type(out["list"][1][1]) is tuple
    assert type(out["tuple"]) is tuple and torch.equal(out["tuple"][2]["k"][0], torch.ones(1))


def test_decoded_tensor_is_a_view_of_the_received_frame():
    frames = [bytearray(memoryview(f).cast("B")) for f in encode({"x": torch.arange(1000.0)})]
    out = decode(frames)
    frame = frames[1]
    start = ctypes.addressof(ctypes.c_char.from_buffer(frame))
    assert start <= out["x"].data_ptr() < start + len(frame)
    frame[0:4] = torch.tensor([42.0]).view(torch.uint8).numpy().tobytes()
    assert out["x"][0].item() == 42.0  # same memory: no copy was made


def test_cuda_tensors_would_be_copied_to_host_once():
    assert "copied to host memory once" in encode.__doc__


def test_unsupported_value_names_its_path_and_type():
    with pytest.raises(WireError) as e:
        encode({"meta": [1, 2, 3, object()]})
    assert str(e.value) == (
        "cannot encode `$.meta[3]`: type builtins.object; accepted: torch.Tensor, numpy.ndarray, "
        "None, bool, int, float, str, bytes, list, tuple, dict with str keys "
        "(convert the value to one of these; rlferry never pickles)"
    )


def test_non_str_dict_key_is_refused_with_its_path():
    with pytest.raises(WireError, match=r"cannot encode `\$\.a\[0\]`: dict key 1 of type int"):
        encode({"a": [{1: "x"}]})


def test_set_and_int_overflow_are_refused():
    with pytest.raises(WireError, match=r"`\$\[1\]`: type builtins.set"):
        encode((1, {2}))
    with pytest.raises(WireError, match="ints must fit in 64 bits"):
        encode(2**70)


def test_strided_nested_and_sparse_tensors_are_refused():
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(
        WireError, match=r"`\$`: a strided nested tensor \(convert it to layout=torch.jagged\)"
    ):
        encode(nt)
    with pytest.raises(WireError, match=r"layout torch\.sparse_coo is not supported"):
        encode(torch.eye(3).to_sparse())


def test_numpy_object_arrays_are_refused():
    with pytest.raises(WireError, match=r"`\$\.a`: numpy dtype object"):
        encode({"a": np.array([object()])})


def test_long_string_lists_travel_packed_out_of_band_and_come_back_as_lists():
    words = [f"prompt {i} " * 50 for i in range(400)]  # > 64 KiB: packed
    blobs = [bytes([i % 256]) * 300 for i in range(400)]
    frames = encode({"w": words, "b": blobs})
    assert len(frames) == 5  # offsets + data for each list, not in the header
    assert len(memoryview(frames[0])) < 1000
    out = roundtrip({"w": words, "b": blobs})
    assert out == {"w": words, "b": blobs}


def test_packed_strings_can_be_kept_packed_and_sliced_without_decoding():
    from rlferry.wire import PackedStrings

    words = ["é" * 100 + str(i) for i in range(1000)]
    frames = [bytearray(memoryview(f).cast("B")) for f in encode(words)]
    packed = decode(frames, forward=True)
    assert isinstance(packed, PackedStrings) and len(packed) == 1000
    assert packed[10:20].tolist() == words[10:20]
    again = roundtrip(PackedStrings.concat([packed[:5], packed[990:]]))
    assert again == words[:5] + words[990:]
