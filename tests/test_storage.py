"""The storage unit's bookkeeping (runs of indexes over stored chunks) against a dict model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlferry.queue import SchemaError
from rlferry.queue.services import StorageUnit

FIELDS = ("a", "b")
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.sampled_from(FIELDS),
            st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True),
        ),
        st.tuples(st.just("drop"), st.just(""), st.lists(st.integers(0, 40), max_size=12)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_reads_and_bytes_match_a_dict_model(steps: list[tuple[str, str, list[int]]]) -> None:
    unit = StorageUnit()
    model: dict[str, dict[int, float]] = {f: {} for f in FIELDS}
    chunk_of: dict[tuple[str, int], int] = {}  # (field, index) -> the store that holds it
    sizes: list[int] = []
    serial = 0.0
    for op, name, indexes in steps:
        if op == "store":
            values = torch.arange(serial, serial + len(indexes), dtype=torch.float64)
            serial += len(indexes)
            unit.store(indexes, {name: values})
            model[name].update(zip(indexes, values.tolist(), strict=True))
            chunk_of.update(((name, i), len(sizes)) for i in indexes)
            sizes.append(8 * len(indexes))
        else:
            unit.drop(indexes)
            for m in model.values():
                for i in indexes:
                    m.pop(i, None)
            for f in FIELDS:
                for i in indexes:
                    chunk_of.pop((f, i), None)
        # a stored column is held while any of its rows is
        assert unit.bytes_held == sum(sizes[c] for c in set(chunk_of.values()))
    for name, m in model.items():
        held = sorted(m)
        if held:  # any order of held indexes reads back the values put last
            order = held[::2] + held[1::2]
            got = unit.read(order, [name])[name]
            assert got.tolist() == [m[i] for i in order]
            assert unit.read(held, [name])[name].tolist() == [m[i] for i in held]
    both = sorted(set(model["a"]) & set(model["b"]))
    if both:  # one read of several fields, each held in its own runs
        got = unit.read(both, [*FIELDS, *FIELDS[::-1]])
        for name in FIELDS:
            assert got[name].tolist() == [model[name][i] for i in both]
    unit.drop(list(range(41)))
    assert unit.bytes_held == 0
    assert unit.statistics().samples == 0


def test_a_contiguous_read_of_one_put_is_a_view() -> None:
    unit = StorageUnit()
    column = torch.arange(10.0)
    unit.store(list(range(100, 110)), {"x": column})
    got = unit.read([103, 104, 105], ["x"])["x"]
    assert got.data_ptr() == column[3:].data_ptr()


def test_a_missing_sample_is_named() -> None:
    unit = StorageUnit()
    unit.store([0, 1, 3], {"x": torch.zeros(3)})
    with pytest.raises(SchemaError) as e:
        unit.read([0, 1, 2, 3], ["x"])
    assert str(e.value) == (
        "field `x`: sample 2 has no value on this storage unit (it was dropped, or never put)"
    )


def test_a_read_of_several_fields_across_puts_takes_every_row() -> None:
    unit = StorageUnit()
    for start in (0, 8):  # two puts of 4 rows, each its own run per field
        rows = list(range(start, start + 4))
        unit.store(rows, {"x": torch.tensor(rows) * 1.0, "y": torch.tensor(rows) * -1.0})
    got = unit.read([0, 1, 2, 3, 8, 9, 10, 11], ["x", "y"])
    assert got["x"].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert got["y"].tolist() == [-0.0, -1, -2, -3, -8, -9, -10, -11]
    whole = unit.read([8, 9, 10, 11], ["y", "x"])  # exactly one put: its columns as they are
    assert whole["x"].tolist() == [8, 9, 10, 11] and whole["y"].tolist() == [-8, -9, -10, -11]
