"""RaggedRows: a list of tensors viewing one flat tensor, sent whole by the codec and the
queue, and read whole by a GRPO batch; a list in every way, also once changed."""

import copy
import pickle

import pytest
import torch

from rlferry.control import Completion, Group, rollout_columns
from rlferry.errors import RequestError
from rlferry.queue import GrpoGroups, Queue, SchemaError
from rlferry.rl.grpo import GrpoBatch, PaddedBatch
from rlferry.wire import RaggedRows, decode, encode
from rlferry.wire.lowlevel import PackedRows


def roundtrip(value):
    return decode([bytearray(memoryview(f).cast("B")) for f in encode(value)])


def rows():
    return RaggedRows(torch.arange(12.0), [[3], [0], [2, 2], [5]])


def test_its_rows_are_views_of_the_flat_tensor_in_order():
    r = rows()
    assert isinstance(r, list) and len(r) == 4
    assert [t.shape for t in r] == [(3,), (0,), (2, 2), (5,)]
    assert torch.equal(r[2], torch.tensor([[3.0, 4.0], [5.0, 6.0]]))
    assert r.offsets == [0, 3, 3, 7, 12]
    r[3][0] = 99.0  # a row's values are the flat tensor's
    assert r.flat is not None and r.flat[7] == 99.0


def test_it_travels_as_its_flat_tensor_and_comes_back_as_ragged_rows():
    r = rows()
    r[0][1] = -1.0
    frames = encode({"x": r})
    assert len(frames) == 2  # the header and the flat tensor
    out = roundtrip({"x": r})["x"]
    assert type(out) is RaggedRows and out.flat is not None
    assert [t.shape for t in out] == [t.shape for t in r]
    assert all(torch.equal(a, b) for a, b in zip(r, out, strict=True))
    assert out[0][1] == -1.0


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r.__setitem__(1, torch.tensor([7.0, 8.0])),
        lambda r: r.append(torch.tensor([1.0])),
        lambda r: r.pop(0),
        lambda r: r.insert(0, torch.tensor([5.0])),
        lambda r: r.reverse(),
        lambda r: r.__delitem__(slice(0, 2)),
        lambda r: r.extend([torch.zeros(2)]),
    ],
)
def test_a_changed_list_forgets_its_flat_tensor_and_travels_row_by_row(change):
    r = rows()
    change(r)
    assert r.flat is None
    out = roundtrip(r)
    assert len(out) == len(r)
    assert all(torch.equal(a, b) for a, b in zip(r, out, strict=True))


def test_a_slice_views_its_part_of_the_flat_tensor_and_other_copies_are_plain_lists():
    r = rows()
    part = r[2:4]
    assert type(part) is RaggedRows and part.offsets == [0, 4, 9]
    assert torch.equal(part.flat, torch.arange(3.0, 12.0))
    assert torch.equal(roundtrip(part)[1], torch.arange(7.0, 12.0))
    assert type(r[::2]) is list and len(r[::2]) == 2
    for other in (pickle.loads(pickle.dumps(r)), copy.copy(r), copy.deepcopy(r)):
        assert type(other) is list and all(torch.equal(a, b) for a, b in zip(r, other, strict=True))


def test_wrong_flat_tensors_are_refused_naming_the_field_and_the_fix():
    with pytest.raises(RequestError, match=r"RaggedRows.flat: expected a 1-d contiguous tensor"):
        RaggedRows(torch.zeros(2, 3), [[6]])
    with pytest.raises(RequestError, match=r"RaggedRows.shapes: expected shapes of 6 values"):
        RaggedRows(torch.zeros(6), [[2], [3]])


def test_a_flat_tensor_that_cannot_travel_is_named_by_its_first_row():
    r = RaggedRows(torch.zeros(4, device="meta"), [[1], [3]])
    why = r"field `x`, at `\$\[0\]`: cannot travel: a meta"
    with (
        Queue(storage_units=1, tasks=("train",)) as q,
        q.client() as c,
        pytest.raises(SchemaError, match=why),
    ):
        c.put("p", {"x": r})


def groups(n=3):
    out = []
    for k in range(n):
        done = [
            Completion(request_id=f"{k}-{i}", prompt_ids=[1, 2, k], token_ids=[k] * (i + 1),
                       logprobs=[-0.5] * (i + 1), versions=[0] * (i + 1), finish_reason="stop")
            for i in range(4)
        ]  # fmt: skip
        out.append(Group(group=k, prompt_ids=[1, 2, k], completions=done))
    return out


def test_rollout_columns_go_through_the_queue_whole_into_the_same_grpo_batch():
    data, meta = rollout_columns(groups())
    assert all(type(data[k]) is RaggedRows for k in ("prompt_ids", "response_ids", "logprobs"))
    data["advantages"] = torch.linspace(-1, 1, 12)
    with Queue(storage_units=1, tasks=("train",)) as q, q.client() as c:
        c.put("train_0", data, meta=meta, timeout=10)
        got = c.get("train_0", task="train", batch_size=12, sampler=GrpoGroups(group_size=4),
                    fields=["prompt_ids", "response_ids", "logprobs", "advantages"],
                    timeout=10).data  # fmt: skip
    assert type(got["response_ids"]) is RaggedRows and got["response_ids"].flat is not None
    whole = PaddedBatch.of(
        GrpoBatch(got["prompt_ids"], got["response_ids"], got["logprobs"], got["advantages"])
    )
    rows = PaddedBatch.of(GrpoBatch(  # the same rows as plain lists of numbers
        [c.prompt_ids for g in groups() for c in g.completions],
        [c.token_ids for g in groups() for c in g.completions],
        [c.logprobs for g in groups() for c in g.completions], data["advantages"]))  # fmt: skip
    for a, b in zip(whole.tensors(), rows.tensors(), strict=True):
        assert torch.equal(a, b)


def test_each_rank_of_two_gets_its_groups_rows_with_their_values():
    data, meta = rollout_columns(groups(4))
    want = dict(enumerate(data["response_ids"]))
    with Queue(storage_units=2, tasks=("train",)) as q, q.client() as c:
        c.put("train_0", {"response_ids": data["response_ids"]}, meta=meta, timeout=10)
        got = [
            c.get("train_0", task="train", batch_size=8, dp_rank=r, dp_size=2,
                  sampler=GrpoGroups(group_size=4), fields=["response_ids"], timeout=10)
            for r in range(2)
        ]  # fmt: skip
    seen = [i for b in got for i in b.indexes]
    assert sorted(seen) == list(range(16))
    for b in got:
        assert isinstance(b.data["response_ids"], list)
        for i, row in zip(b.indexes, b.data["response_ids"], strict=True):
            assert torch.equal(row, want[i])


def test_a_service_that_forwards_holds_packed_rows_without_a_tensor_a_row():
    r = rows()
    held = decode([bytes(f) for f in encode(r)], forward=True)
    assert type(held) is PackedRows and len(held) == 4 and held.nbytes == 48
    part = held[1:3]
    assert part.shapes == [[0], [2, 2]] and torch.equal(part.flat, torch.arange(3.0, 7.0))
    both = PackedRows.concat([held[3:4], held[0:1]])
    assert both.offsets == [0, 5, 8]
    back = roundtrip(both)  # sent on whole, as rows
    assert type(back) is RaggedRows
    assert torch.equal(back[0], torch.arange(7.0, 12.0)) and torch.equal(back[1], r[0])
    assert all(torch.equal(a, b) for a, b in zip(held.tolist(), r, strict=True))
    with pytest.raises(RequestError, match="PackedRows: expected a slice of step 1, got step 2"):
        held[::2]


def test_a_get_across_puts_joins_their_rows_and_keeps_each_puts_dtype():
    ints = RaggedRows(torch.arange(6), [[2], [4]])
    more = [torch.arange(3), torch.arange(1)]  # a plain list: packed on the wire too
    floats = RaggedRows(torch.linspace(0, 1, 3), [[1], [2]])
    with Queue(storage_units=1, tasks=("a", "b")) as q, q.client() as c:
        c.put("p", {"x": ints}, timeout=10)
        c.put("p", {"x": more}, timeout=10)
        same = c.get("p", task="a", batch_size=4, fields=["x"], timeout=10).data["x"]
        c.put("q", {"x": ints}, timeout=10)
        c.put("q", {"x": floats}, timeout=10)
        mixed = c.get("q", task="b", batch_size=4, fields=["x"], timeout=10).data["x"]
    assert type(same) is RaggedRows and same.flat is not None  # one flat tensor, joined
    for a, b in zip(same, [*ints, *more], strict=True):
        assert torch.equal(a, b)
    assert [t.dtype for t in mixed] == [torch.int64] * 2 + [torch.float32] * 2
    for a, b in zip(mixed, [*ints, *floats], strict=True):
        assert torch.equal(a, b)
