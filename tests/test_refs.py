"""Tensor references: a forwarding service holds shared-memory tensors by place, not as torch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlferry.wire import Client, Server, TensorRef, decode, default_address, encode, wire_loop
from rlferry.wire.memory._bulk import BulkFrame
from rlferry.wire.memory._segments import AVAILABLE


def forwarded(value: Any) -> Any:
    """``value`` as a forwarding service decodes it when its bytes lie in shared memory."""
    frames = encode(value)
    bulk = [frames[0]]
    for f in frames[1:]:
        view = memoryview(bytearray(memoryview(f).cast("B")))
        bulk.append(BulkFrame(view, 0, view.nbytes))
    return decode(bulk, forward=True)


def test_a_reference_slices_rows_and_builds_its_tensor() -> None:
    x = torch.arange(24, dtype=torch.float32).reshape(6, 2, 2)
    r = forwarded(x)
    assert isinstance(r, TensorRef)
    assert (r.dtype, r.shape, r.nbytes, len(r)) == ("float32", [6, 2, 2], 96, 6)
    assert torch.equal(r.tensor(), x)
    part = r[2:5]
    assert (part.shape, part.nbytes) == ([3, 2, 2], 48)
    assert torch.equal(part.tensor(), x[2:5])
    assert part[1:].tensor().tolist() == x[3:5].tolist()
    assert r[4:2].shape == [0, 2, 2] and r[4:2].tensor().shape == (0, 2, 2)
    with pytest.raises(IndexError, match="contiguous row slices only"):
        r[::2]
    with pytest.raises(TypeError, match=r"row slices \(ref\[a:b\]\)"):
        r[1]


def test_a_reference_sent_without_shared_memory_travels_as_its_bytes() -> None:
    refs = forwarded({"a": torch.arange(5), "b": torch.ones(2, 3, dtype=torch.bfloat16)})
    assert all(isinstance(v, TensorRef) for v in refs.values())
    out = decode(encode({"cols": refs, "row": refs["a"][1:3]}))
    assert torch.equal(out["cols"]["a"], torch.arange(5))
    assert torch.equal(out["cols"]["b"], torch.ones(2, 3, dtype=torch.bfloat16))
    assert out["row"].tolist() == [1, 2]


def test_small_tensors_from_the_socket_stay_tensors() -> None:
    frames = [bytearray(memoryview(f).cast("B")) for f in encode({"x": torch.arange(3)})]
    out = decode(frames, forward=True)
    assert type(out["x"]) is torch.Tensor


@pytest.mark.skipif(not AVAILABLE, reason="needs memfd shared memory (Linux)")
def test_a_forwarding_service_holds_references_and_sends_rows_on() -> None:
    held: dict[str, Any] = {}

    async def store_and_forward(value: Any, peer: bytes) -> Any:
        op, arg = value
        if op == "put":
            held.update(arg)
            return sorted(type(v).__name__ for v in arg.values())
        a, b = arg
        return {k: v[a:b] for k, v in held.items()}

    srv = Server(store_and_forward, default_address("ipc"), forward=True)
    wire_loop().run(srv.start())
    try:
        columns = {f"f{i}": torch.randn(256, 128) for i in range(4)}  # 128 KiB each: bulk
        columns["ids"] = torch.arange(256 * 64).reshape(256, 64)
        with Client(srv.address) as c:
            assert c.request(["put", columns], timeout=10) == ["TensorRef"] * 5
            rows = c.request(["get", [10, 20]], timeout=10)
        assert list(rows) == list(columns)
        for name, col in columns.items():
            assert torch.equal(rows[name], col[10:20])
    finally:
        wire_loop().run(srv.aclose())
        held.clear()
