"""Malformed messages raise WireError: never a crash, a hang or an attacker-sized allocation."""

import contextlib

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlferry.wire import WireError, decode, encode, shared_empty
from rlferry.wire._codec import EXT_RAGGED, EXT_TENSOR, EXT_TENSORS, MAGIC


def frames_of(value):
    return [bytearray(memoryview(f).cast("B")) for f in encode(value)]


def header(tree, nframes):
    return msgspec.msgpack.encode([MAGIC, nframes, tree])


def tensor_ext(dtype, shape, frame):
    return msgspec.msgpack.Ext(EXT_TENSOR, msgspec.msgpack.encode([dtype, shape, frame]))


def test_no_frames():
    with pytest.raises(
        WireError, match=r"^malformed message: no frames \(expected a header frame\)$"
    ):
        decode([])


def test_missing_frame():
    frames = frames_of({"a": torch.ones(4), "b": torch.zeros(2)})
    with pytest.raises(WireError, match="header announces 2 data frames, 1 arrived"):
        decode(frames[:-1])


def test_extra_frame():
    frames = frames_of(torch.ones(4))
    with pytest.raises(WireError, match=r"header announces 1 data frames, 2 arrived"):
        decode([*frames, bytearray(8)])


def test_truncated_header():
    frames = frames_of({"a": torch.ones(4)})
    with pytest.raises(WireError, match=r"^malformed message: the header is not an rlferry header"):
        decode([frames[0][:-3], *frames[1:]])


def test_truncated_data_frame():
    frames = frames_of(torch.ones(4))
    with pytest.raises(
        WireError, match=(r"tensor of shape \[4\] and dtype float32 needs 16 bytes, frame 1 has 12")
    ):
        decode([frames[0], frames[1][:12]])


def test_not_an_rlferry_header():
    with pytest.raises(WireError, match="the header is not an rlferry header"):
        decode([msgspec.msgpack.encode({"x": 1})])


def test_absurd_shape_allocates_nothing():
    # 2**62 elements claimed over an 8-byte frame: refused before any allocation
    msg = [header(tensor_ext("float32", [2**31, 2**31], 1), 1), bytearray(8)]
    with pytest.raises(WireError, match="needs 18446744073709551616 bytes, frame 1 has 8"):
        decode(msg)


def test_empty_tensor_with_huge_dimension_allocates_nothing():
    msg = [header(tensor_ext("float32", [0, 2**62], 1), 1), bytearray(0)]
    out = decode(msg)
    assert out.shape == (0, 2**62)


def test_negative_dimension_and_unknown_dtype():
    with pytest.raises(WireError, match=r"\[-1\] is not a shape"):
        decode([header(tensor_ext("float32", [-1], 1), 1), bytearray(4)])
    with pytest.raises(WireError, match="unknown dtype 'object'"):
        decode([header(tensor_ext("object", [1], 1), 1), bytearray(8)])


def test_frame_index_out_of_range_or_used_twice():
    with pytest.raises(WireError, match=r"a tensor names frame 5, the message has frames 1..1"):
        decode([header(tensor_ext("uint8", [1], 5), 1), bytearray(1)])
    two = [tensor_ext("uint8", [1], 1), tensor_ext("uint8", [1], 1)]
    with pytest.raises(WireError, match="frame 1 is used twice"):
        decode([header(two, 1), bytearray(1)])


def test_unused_frame():
    with pytest.raises(WireError, match="frame 1 is not used by the header"):
        decode([header([], 1), bytearray(1)])


def test_ragged_shapes_that_do_not_fit_the_frame():
    ext = msgspec.msgpack.Ext(EXT_RAGGED, msgspec.msgpack.encode(["int64", [[2], [3]], 1]))
    with pytest.raises(WireError, match="ragged shapes need 40 bytes, frame 1 has 32"):
        decode([header(ext, 1), bytearray(32)])


def test_unknown_extension_code():
    ext = msgspec.msgpack.Ext(99, b"\x90")
    with pytest.raises(WireError, match="unknown extension code 99"):
        decode([header(ext, 0)])


def test_deeply_nested_header_is_refused_not_a_crash():
    deep = b"\x91" * 100_000 + b"\xc0"
    msg = msgspec.msgpack.encode([MAGIC, 0, None])[:-1] + deep
    with pytest.raises(WireError):
        decode([msg])


SAMPLE = {
    "t": torch.arange(12, dtype=torch.int32).reshape(3, 4),
    "r": [torch.ones(2), torch.ones(3)],
    "j": torch.nested.nested_tensor([torch.ones(2, 2), torch.ones(1, 2)], layout=torch.jagged),
    "m": ("x", 1, b"y"),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_messages_raise_only_wire_error(data):
    frames = frames_of(SAMPLE)
    i = data.draw(st.integers(0, len(frames) - 1))
    f = frames[i]
    op = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop", "dup"]))
    if op == "flip" and len(f):
        pos = data.draw(st.integers(0, len(f) - 1))
        f[pos] ^= data.draw(st.integers(1, 255))
    elif op == "truncate":
        frames[i] = f[: data.draw(st.integers(0, max(0, len(f) - 1)))]
    elif op == "extend":
        frames[i] = f + bytearray(data.draw(st.binary(min_size=1, max_size=16)))
    elif op == "drop":
        del frames[i]
    else:
        frames.insert(i, bytearray(f))
    with contextlib.suppress(WireError):  # the only failure allowed
        decode(frames)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_fuzz_random_bytes_raise_only_wire_error(frames):
    with contextlib.suppress(WireError):  # the only failure allowed
        decode([bytearray(f) for f in frames])


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(values)
def test_fuzz_plain_values_round_trip(value):
    assert decode(frames_of(value)) == value


def shared_ext(dtype, shape, frame, offset):
    return msgspec.msgpack.Ext(EXT_TENSOR, msgspec.msgpack.encode([dtype, shape, frame, offset]))


@pytest.mark.parametrize(
    ("offset", "message"),
    [
        (60, r"tensor of 16 bytes at offset 60 of frame 1, which has 64"),
        (-4, r"tensor of 16 bytes at offset -4 of frame 1, which has 64"),
        ("0", r"tensor of 16 bytes at offset '0' of frame 1, which has 64"),
    ],
)
def test_shared_frame_offset_out_of_range(offset, message):
    tree = [shared_ext("float32", [4], 1, 0), shared_ext("float32", [4], 1, offset)]
    with pytest.raises(WireError, match=rf"^malformed message: {message}$"):
        decode([header(tree, 1), bytearray(64)])


def test_frame_used_alone_and_shared():
    tree = [tensor_ext("float32", [16], 1), shared_ext("float32", [4], 1, 0)]
    with pytest.raises(WireError, match=r"^malformed message: frame 1 is used twice$"):
        decode([header(tree, 1), bytearray(64)])
    tree = [shared_ext("float32", [4], 1, 0), tensor_ext("float32", [16], 1)]
    with pytest.raises(WireError, match=r"^malformed message: frame 1 is used twice$"):
        decode([header(tree, 1), bytearray(64)])


def test_shared_frame_decodes_views_at_their_offsets():
    data = bytearray(torch.arange(16, dtype=torch.float32).numpy().tobytes())
    tree = [shared_ext("float32", [2, 2], 1, 8), shared_ext("int16", [3], 1, 2)]
    a, b = decode([header(tree, 1), data])
    assert torch.equal(a, torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
    assert torch.equal(b, torch.frombuffer(data, dtype=torch.int16)[1:4])
    a[0, 0] = 7.0  # views of the frame: no copy
    assert torch.frombuffer(data, dtype=torch.float32)[2] == 7.0


def tensor_dict_ext(frame, groups):
    return msgspec.msgpack.Ext(EXT_TENSORS, msgspec.msgpack.encode([frame, groups]))


GROUP = r"a tensor group is not \[keys, dtype, shape, byte offset, byte step >= 0\]"


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ([1, [[["a"], "float32", [4], 0, 0]], 9], r"a tensor dict node is not \[frame, groups\]"),
        ([1, [[["a"], "float32", [4], 0]]], GROUP),
        ([1, [["a", "float32", [4], 0, 0]]], GROUP),
        ([1, [[[], "float32", [4], 0, 0]]], GROUP),
        ([1, [[["a", 3], "float32", [4], 0, 0]]], GROUP),
        ([1, [[["a"], "float32", [4], 0.0, 0]]], GROUP),
        ([1, [[["a", "b"], "float32", [4], 0, -16]]], GROUP),
        ([1, [[["a"], "float99", [4], 0, 0]]], r"unknown dtype 'float99'"),
        ([1, [[["a"], "float32", [4, True], 0, 0]]], r"\[4, True\] is not a shape \(.*\)"),
        (
            [1, [[["a"], "float32", [4], 56, 0]]],
            "tensor of 16 bytes at offset 56 of frame 1, which has 64",
        ),
        (
            [1, [[["a", "b", "c", "d", "e"], "float32", [2], 0, 16]]],
            "tensor of 8 bytes at offset 64 of frame 1, which has 64",
        ),
        (
            [2, [[["a"], "float32", [4], 0, 0]]],
            r"a tensor names frame 2, the message has frames 1\.\.1",
        ),
    ],
)
def test_malformed_tensor_dict(node, message):
    tree = msgspec.msgpack.Ext(EXT_TENSORS, msgspec.msgpack.encode(node))
    with pytest.raises(WireError, match=rf"^malformed message: {message}$"):
        decode([header(tree, 1), bytearray(64)])


def test_tensor_dict_decodes_views_at_their_offsets():
    data = bytearray(torch.arange(16, dtype=torch.float32).numpy().tobytes())
    tree = tensor_dict_ext(1, [[["a"], "float32", [2, 2], 8, 0], [["b"], "int16", [3], 2, 0]])
    out = decode([header(tree, 1), data])
    assert torch.equal(out["a"], torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
    assert torch.equal(out["b"], torch.frombuffer(data, dtype=torch.int16)[1:4])


@pytest.mark.parametrize(("at", "step"), [(0, 16), (8, 12), (4, 8), (0, 8)])
def test_a_tensor_group_decodes_each_tensor_at_its_own_offset(at, step):
    values = torch.arange(16, dtype=torch.float32)
    data = bytearray(values.numpy().tobytes())
    keys = ["a", "b", "c", "d"]
    tree = tensor_dict_ext(1, [[keys, "float32", [2], at, step]])
    out = decode([header(tree, 1), data])
    assert list(out) == keys
    for i, k in enumerate(keys):
        first = (at + i * step) // 4
        assert torch.equal(out[k], values[first : first + 2])
    out["b"][0] = -1.0  # views of the frame, each its own tensor
    assert torch.frombuffer(data, dtype=torch.float32)[(at + step) // 4] == -1.0


def test_a_tensor_group_at_unaligned_offsets_comes_as_its_bytes():
    data = bytearray(range(64))
    out = decode([header(tensor_dict_ext(1, [[["a", "b"], "int16", [2], 1, 4]]), 1), data])
    assert out["a"].tolist() == torch.frombuffer(data[1:5], dtype=torch.int16).tolist()
    assert out["b"].tolist() == torch.frombuffer(data[5:9], dtype=torch.int16).tolist()


@pytest.mark.parametrize(("shape", "step"), [([2], 0), ([2], 7), ([0], 0)])
def test_a_tensor_group_whose_tensors_overlap_is_refused(shape, step):
    # a step below the tensor's size would let one small frame feed any number of tensors
    keys = [f"k{i}" for i in range(1000)]
    tree = tensor_dict_ext(1, [[keys, "float32", shape, 0, step]])
    with pytest.raises(WireError) as e:
        decode([header(tree, 1), bytearray(64)])
    nbytes = 4 * shape[0]
    assert str(e.value) == (
        f"malformed message: a tensor group of {nbytes}-byte tensors has byte step {step} "
        "(its tensors must not overlap)"
    )


def test_a_service_of_plain_values_refuses_a_tensor_before_building_it():
    frames = encode({"op": "get", "x": torch.ones(3)})
    with pytest.raises(WireError) as e:
        decode(frames, tensors=False)
    assert str(e.value) == (
        "malformed message: a tensor, array or packed list in a message to a service that "
        "takes plain values only"
    )
    assert decode(encode({"op": "get", "t": (1, 2)}), tensors=False) == {"op": "get", "t": (1, 2)}


def test_the_encoder_groups_columns_of_one_shape_laid_out_evenly():
    size = 1 << 16  # the storage is larger than the smallest frame sent by shared memory
    flat = shared_empty([size * 8], torch.uint8)
    cols = {f"f{i}": flat[i * size : (i + 1) * size].view(torch.float32) for i in range(6)}
    cols["odd"] = flat[6 * size : 6 * size + 64].view(torch.int16)  # another dtype: its group
    cols["back"] = cols["f0"]  # an offset behind the last: a group of its own
    cols["again"] = cols["f0"]  # the same tensor again: not a group with a step of 0
    for t in cols.values():
        t.copy_(torch.arange(t.numel()))
    frames = encode(cols, shared=True)
    if len(frames) != 2:
        pytest.skip("no shared memory here: one frame per tensor")
    _, _, tree = msgspec.msgpack.decode(frames[0])
    groups = msgspec.msgpack.decode(tree.data)[1]
    assert [g[0] for g in groups] == [[f"f{i}" for i in range(6)], ["odd"], ["back"], ["again"]]
    assert groups[0][3:] == [0, size]
    out = decode(frames)
    assert all(torch.equal(out[k], t) for k, t in cols.items())
