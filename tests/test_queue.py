"""The rollout queue: puts, gets, tasks, DP shares, samplers, leases, backpressure, errors."""

import threading
import time

import numpy as np
import pytest
import torch

from rlferry.queue import (
    GetTimeout,
    GrpoGroups,
    PutTimeout,
    Queue,
    SchemaError,
    SeqlenBalanced,
    UnknownTask,
)
from rlferry.queue.statistics import TaskStatistics
from rlferry.wire import FileFormatError


@pytest.fixture
def q():
    with Queue(storage_units=2, tasks=("actor_train", "critic_train")) as queue:
        yield queue


def put_rows(c, partition, n, start=0, **kw):
    return c.put(partition, {"x": torch.arange(start, start + n).float().unsqueeze(1)}, **kw)


def test_put_then_get_returns_every_kind_exactly(q):
    c = q.client()
    tokens = [torch.arange(3), torch.arange(7), torch.arange(1)]
    nested = torch.nested.nested_tensor(
        [torch.ones(2, 4), torch.ones(5, 4), torch.ones(1, 4)], layout=torch.jagged
    )
    data = {
        "tokens": tokens,
        "rewards": torch.tensor([1.0, 0.0, 0.5]),
        "logprobs": torch.randn(3, 16, dtype=torch.bfloat16),
        "prompt": ["a", "b", "c"],
        "nested": nested,
        "np": np.arange(6, dtype=np.int32).reshape(3, 2),
    }
    idx = c.put("train_0", data, meta={"group": [0, 0, 1]}, partition_meta={"num_microbatches": 2})
    assert idx == [0, 1, 2]
    b = c.get("train_0", task="actor_train", batch_size=3, fields=list(data), timeout=10)
    assert b.indexes == idx and len(b) == 3
    assert isinstance(b.data["tokens"], list)
    assert all(torch.equal(a, o) for a, o in zip(tokens, b.data["tokens"], strict=True))
    assert torch.equal(b.data["rewards"], data["rewards"])
    assert b.data["logprobs"].dtype == torch.bfloat16
    assert torch.equal(b.data["logprobs"], data["logprobs"])
    assert b.data["prompt"] == ["a", "b", "c"]
    assert b.data["nested"].is_nested and b.data["nested"].layout == torch.jagged
    for a, o in zip(nested.unbind(), b.data["nested"].unbind(), strict=True):
        assert torch.equal(a, o)
    assert np.array_equal(b.data["np"], data["np"])
    assert b.meta == {"group": [0, 0, 1]}
    assert b.partition_meta == {"num_microbatches": 2}


def test_put_with_indexes_adds_fields_and_get_waits_for_them(q):
    c = q.client()
    idx = put_rows(c, "p", 4)
    with pytest.raises(GetTimeout):
        c.get("p", task="actor_train", batch_size=4, fields=["x", "adv"], timeout=0.2)
    c.put("p", {"adv": torch.full((4,), 2.0)}, indexes=idx)
    b = c.get("p", task="actor_train", batch_size=4, fields=["x", "adv"], timeout=5)
    assert torch.equal(b.data["adv"], torch.full((4,), 2.0))
    assert torch.equal(b.data["x"].squeeze(1), torch.arange(4).float())


def test_get_blocks_until_a_put_completes_the_batch(q):
    c = q.client()
    put_rows(c, "p", 2)
    threading.Timer(0.3, lambda: put_rows(c, "p", 2, start=2)).start()
    t0 = time.monotonic()
    b = c.get("p", task="actor_train", batch_size=4, fields=["x"], timeout=10)
    assert time.monotonic() - t0 >= 0.25
    assert b.indexes == [0, 1, 2, 3]


def test_get_can_wait_for_a_partition_that_does_not_exist_yet(q):
    c = q.client()
    threading.Timer(0.2, lambda: put_rows(c, "later", 1)).start()
    assert c.get("later", task="actor_train", batch_size=1, fields=["x"], timeout=10).indexes == [0]


def test_get_timeout_names_what_was_missing_and_leases_nothing(q):
    c = q.client()
    put_rows(c, "p", 3)
    with pytest.raises(GetTimeout) as e:
        c.get("p", task="actor_train", batch_size=4, fields=["x"], timeout=0.2)
    assert str(e.value) == (
        "get `p` for task `actor_train`: 3 ready samples with fields ['x'] within 0.2 s, "
        "a batch needs 4 per rank x 1 ranks (partition `p` holds fields ['x']; producers must "
        "put more, or wait longer)"
    )
    assert isinstance(e.value, TimeoutError)
    assert c.get("p", task="actor_train", batch_size=3, fields=["x"], timeout=5).indexes == [
        0,
        1,
        2,
    ]


def test_each_task_reads_every_sample_once(q):
    c = q.client()
    put_rows(c, "p", 4)
    a = c.get("p", task="actor_train", batch_size=4, fields=["x"], timeout=5)
    b = c.get("p", task="critic_train", batch_size=4, fields=["x"], timeout=5)
    assert a.indexes == b.indexes == [0, 1, 2, 3]
    c.ack(a)
    with pytest.raises(GetTimeout):
        c.get("p", task="actor_train", batch_size=1, fields=["x"], timeout=0.2)


def test_two_tasks_two_dp_ranks_identical_for_callers_of_one_rank(q):
    peers = [q.client(), q.client()]  # e.g. two TP ranks of one DP rank
    producer = q.client()
    put_rows(producer, "p", 8)
    for task in ("actor_train", "critic_train"):
        seen = []
        for rank in (0, 1):
            got = [
                p.get(
                    "p", task=task, batch_size=4, fields=["x"], dp_rank=rank, dp_size=2, timeout=5
                )
                for p in peers
            ]
            assert got[0].indexes == got[1].indexes
            assert torch.equal(got[0].data["x"], got[1].data["x"])
            seen.append(set(got[0].indexes))
        assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(range(8))


def test_grpo_groups_are_never_split_across_ranks(q):
    c = q.client()
    groups = [0, 1, 0, 2, 1, 2, 0, 1, 3, 2, 3, 3]  # 4 groups of 3, interleaved
    put_rows(c, "p", 12, meta={"group": groups})
    sampler = GrpoGroups(group_size=3)
    shares = [
        c.get(
            "p",
            task="actor_train",
            batch_size=6,
            fields=["x"],
            dp_rank=r,
            dp_size=2,
            sampler=sampler,
            timeout=5,
        )
        for r in (0, 1)
    ]
    for b in shares:
        assert sorted(b.meta["group"]) == sorted(set(b.meta["group"])) * 0 + sorted(b.meta["group"])
        counts = {g: b.meta["group"].count(g) for g in b.meta["group"]}
        assert set(counts.values()) == {3}  # whole groups only
    assert set(shares[0].meta["group"]).isdisjoint(shares[1].meta["group"])


def test_grpo_groups_batch_must_hold_whole_groups(q):
    c = q.client()
    put_rows(c, "p", 4, meta={"group": [0, 0, 1, 1]})
    msg = "batch_size: expected a multiple of group_size 2, got 3"
    with pytest.raises(SchemaError, match=msg):
        c.get(
            "p",
            task="actor_train",
            batch_size=3,
            fields=["x"],
            sampler=GrpoGroups(group_size=2),
            timeout=5,
        )


def test_seqlen_balanced_evens_out_total_length_across_ranks(q):
    c = q.client()
    lengths = [100, 1, 90, 2, 80, 3, 70, 4]
    put_rows(c, "p", 8, meta={"seqlen": lengths})
    totals = []
    for r in (0, 1):
        b = c.get(
            "p",
            task="actor_train",
            batch_size=4,
            fields=["x"],
            dp_rank=r,
            dp_size=2,
            sampler="seqlen_balanced",
            timeout=5,
        )
        totals.append(sum(b.meta["seqlen"]))
    assert abs(totals[0] - totals[1]) <= 20  # sequential would give 193 vs 157


def test_seqlen_balanced_needs_the_length_meta(q):
    c = q.client()
    put_rows(c, "p", 2)
    with pytest.raises(
        SchemaError, match=r"meta `seqlen`: expected a number for sample 0, got None"
    ):
        c.get(
            "p", task="actor_train", batch_size=2, fields=["x"], sampler=SeqlenBalanced(), timeout=5
        )


def test_expired_lease_makes_samples_available_again():
    with Queue(storage_units=1, tasks=("train",), lease_timeout=0.3) as q:
        c = q.client()
        put_rows(c, "p", 2)
        first = c.get("p", task="train", batch_size=2, fields=["x"], timeout=5)
        # not acked: after the lease expires the same samples come again
        again = q.client().get("p", task="train", batch_size=2, fields=["x"], timeout=5)
        assert again.indexes == first.indexes
        assert c.ack(again) == 2


def test_partition_is_freed_once_every_task_acked_it(q):
    c = q.client()
    put_rows(c, "p", 2)
    for task in ("actor_train", "critic_train"):
        c.ack(c.get("p", task=task, batch_size=2, fields=["x"], timeout=5))
    stats = c.statistics()
    assert stats.partitions == {} and stats.samples_held == 0
    assert stats.bytes_held == 0


def test_clear_drops_a_partition_and_its_data(q):
    c = q.client()
    put_rows(c, "p", 3)
    assert c.clear("p") == 3
    stats = c.statistics()
    assert stats.partitions == {} and stats.bytes_held == 0


def test_capacity_makes_put_wait_until_consumers_free_room():
    with Queue(storage_units=1, tasks=("train",), capacity=4) as q:
        c = q.client()
        put_rows(c, "p", 4)
        with pytest.raises(PutTimeout) as e:
            put_rows(c, "p", 1, timeout=0.2)
        assert str(e.value) == (
            "put `p`: no room within 0.2 s (held 4 samples of capacity 4, 1 partitions of "
            "max_partitions None; consumers must ack or clear)"
        )
        b = c.get("p", task="train", batch_size=2, fields=["x"], timeout=5)
        threading.Timer(0.2, lambda: c.ack(b)).start()
        assert put_rows(c, "p", 2, timeout=10) == [4, 5]  # waited for the ack, by event


def test_max_partitions_bounds_unfinished_partitions():
    with Queue(storage_units=1, tasks=("train",), max_partitions=1) as q:
        c = q.client()
        put_rows(c, "step_0", 1)
        with pytest.raises(PutTimeout):
            put_rows(c, "step_1", 1, timeout=0.2)
        c.ack(c.get("step_0", task="train", batch_size=1, fields=["x"], timeout=5))
        assert put_rows(c, "step_1", 1, timeout=5) == [1]


def test_statistics_report_depth_leases_and_bytes(q):
    c = q.client()
    put_rows(c, "p", 4)
    c.get("p", task="actor_train", batch_size=2, fields=["x"], timeout=5)
    stats = c.statistics()
    tasks = stats.partitions["p"].tasks
    assert tasks["actor_train"] == TaskStatistics(depth=2, leased=2)
    assert tasks["critic_train"] == TaskStatistics(depth=4, leased=0)
    assert stats.leases == 1 and stats.samples_held == 4
    assert stats.bytes_held == 4 * 4
    assert stats.waiting_gets == 0 and stats.waiting_puts == 0
    assert [u.alive for u in stats.storage_units] == [True, True]
    assert all(u.address.startswith("ipc://") for u in stats.storage_units)


def test_save_and_restore_keep_state_and_data(q, tmp_path):
    c = q.client()
    idx = c.put(
        "p",
        {"x": torch.arange(4.0), "s": ["a", "b", "c", "d"]},
        meta={"g": [1, 1, 2, 2]},
        partition_meta={"k": 1},
    )
    c.ack(c.get("p", task="actor_train", batch_size=2, fields=["x"], timeout=5))
    q.save(tmp_path / "snap")
    with Queue.restore(tmp_path / "snap") as r:
        rc = r.client()
        b = rc.get("p", task="actor_train", batch_size=2, fields=["x", "s"], timeout=5)
        assert b.indexes == idx[2:] and b.data["s"] == ["c", "d"] and b.meta == {"g": [2, 2]}
        full = rc.get("p", task="critic_train", batch_size=4, fields=["x"], timeout=5)
        assert torch.equal(full.data["x"], torch.arange(4.0)) and full.partition_meta == {"k": 1}
        assert rc.put("p", {"x": torch.zeros(1), "s": ["e"]}) == [4]  # indexes go on


def test_after_restore_what_was_acked_is_not_delivered_and_what_was_leased_is(q, tmp_path):
    c = q.client()
    idx = put_rows(c, "p", 6)
    c.ack(c.get("p", task="actor_train", batch_size=2, fields=["x"], timeout=5))
    leased = c.get("p", task="actor_train", batch_size=2, fields=["x"], timeout=5)
    assert leased.indexes == idx[2:4]  # delivered, never acked
    q.save(tmp_path / "snap")
    with Queue.restore(tmp_path / "snap") as r:
        rc = r.client()
        again = rc.get("p", task="actor_train", batch_size=4, fields=["x"], timeout=5)
        assert again.indexes == idx[2:]
        assert again.data["x"].reshape(-1).tolist() == [2.0, 3.0, 4.0, 5.0]
        critic = rc.get("p", task="critic_train", batch_size=6, fields=["x"], timeout=5)
        assert critic.indexes == idx


def test_a_second_save_replaces_the_first_whole(q, tmp_path):
    c = q.client()
    put_rows(c, "p", 2)
    q.save(tmp_path / "snap")
    put_rows(c, "p", 2, start=2)
    q.save(tmp_path / "snap")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]
    with Queue.restore(tmp_path / "snap") as r:
        got = r.client().get("p", task="actor_train", batch_size=4, fields=["x"], timeout=5)
        assert got.data["x"].reshape(-1).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_save_never_replaces_a_directory_of_other_files(q, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError) as e:
        q.save(tmp_path)
    assert str(e.value) == (
        f"{tmp_path}: expected a checkpoint to replace (holding controller.rlf), an empty "
        "directory or a new path, got other files (write the checkpoint to a new path)"
    )
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("damage", ["one byte changed", "truncated"])
def test_a_damaged_queue_checkpoint_is_refused_naming_the_file(q, tmp_path, damage):
    put_rows(q.client(), "p", 64)
    q.save(tmp_path / "snap")
    unit = tmp_path / "snap" / "unit-0.rlf"
    data = bytearray(unit.read_bytes())
    if damage == "truncated":
        del data[-10:]
    else:
        data[len(data) // 2] ^= 0xFF
    unit.write_bytes(data)
    with pytest.raises(FileFormatError) as e:
        Queue.restore(tmp_path / "snap")
    what = "truncated: expected" if damage == "truncated" else "checksum mismatch"
    assert str(e.value).startswith(f"{unit}: {what}")


def test_a_queue_checkpoint_that_is_a_pickle_is_refused(q, tmp_path):
    q.save(tmp_path / "snap")
    torch.save({"state": 1}, tmp_path / "snap" / "controller.rlf")
    with pytest.raises(FileFormatError, match=r"it starts like a torch\.save archive"):
        Queue.restore(tmp_path / "snap")


def test_blocked_get_uses_no_cpu_while_waiting(q):
    c = q.client()
    start = time.process_time()
    with pytest.raises(GetTimeout):
        c.get("p", task="actor_train", batch_size=1, fields=["x"], timeout=2.0)
    assert time.process_time() - start < 0.2  # a busy loop would burn ~2 s


# -- bad input ------------------------------------------------------------------------------


def test_fields_with_different_sample_counts_are_refused(q):
    with pytest.raises(SchemaError) as e:
        q.client().put("p", {"tokens": torch.zeros(64, 2), "rewards": torch.zeros(63)})
    assert str(e.value) == (
        "field `rewards`: expected 64 rows (as field `tokens`), got 63 "
        "(every field of one put must have the same number of samples)"
    )


def test_unknown_task_is_refused(q):
    with pytest.raises(UnknownTask) as e:
        q.client().get("p", task="reward", batch_size=1, fields=["x"], timeout=1)
    assert str(e.value) == (
        "task `reward`: expected one of ['actor_train', 'critic_train'] "
        "(register every task when the queue starts: Queue(tasks=...) or "
        "`rlferry serve queue --tasks`)"
    )


def test_non_string_partition_is_refused(q):
    with pytest.raises(SchemaError) as e:
        q.client().put(17, {"x": torch.zeros(1)})
    assert str(e.value) == (
        "partition: expected a non-empty str, got int 17 (name partitions like 'train_17')"
    )


def test_unsupported_value_names_the_field_and_loses_nothing(q):
    c = q.client()
    with pytest.raises(SchemaError) as e:
        c.put("p", {"prompt": ["a", object()]})
    assert str(e.value).startswith("field `prompt`, at `$[1]`: type builtins.object; accepted:")
    assert c.statistics().samples_held == 0  # the failed put left nothing behind
    assert put_rows(c, "p", 1) == [0]


def test_changing_a_fields_shape_is_refused(q):
    c = q.client()
    c.put("p", {"x": torch.zeros(2, 8)})
    with pytest.raises(SchemaError) as e:
        c.put("p", {"x": torch.zeros(2, 4)})
    assert str(e.value) == (
        "field `x`: expected tensor of float32 rows of shape [8] as in earlier puts of `p`, got "
        "tensor of float32 rows of shape [4] (one field keeps one kind, dtype and row shape; "
        "send rows of different lengths as a list of tensors)"
    )


def test_adding_fields_to_unknown_indexes_is_refused(q):
    c = q.client()
    put_rows(c, "p", 1)
    with pytest.raises(SchemaError, match=r"indexes: \[99\] are not samples of partition `p`"):
        c.put("p", {"y": torch.zeros(1)}, indexes=[99])
    with pytest.raises(SchemaError) as e:
        c.put("p", {"y": torch.zeros(2)}, indexes=[0, 0])
    assert str(e.value) == (
        "indexes: expected 2 distinct ints, got a repeated one in [0, 0] "
        "(one row of data per sample)"
    )


def test_bad_get_arguments_are_refused(q):
    c = q.client()
    with pytest.raises(SchemaError, match=r"dp_rank: expected an int in \[0, 2\), got 2"):
        c.get("p", task="actor_train", batch_size=1, fields=["x"], dp_rank=2, dp_size=2)
    with pytest.raises(SchemaError, match="batch_size: expected a positive int, got 0"):
        c.get("p", task="actor_train", batch_size=0, fields=["x"])
    with pytest.raises(SchemaError, match="fields: expected a non-empty list of field names"):
        c.get("p", task="actor_train", batch_size=1, fields=[])


def test_bad_queue_config_is_refused():
    with pytest.raises(SchemaError, match="storage_units: expected an int >= 1, got 0"):
        Queue(storage_units=0)
    with pytest.raises(SchemaError, match="capacity: expected None or an int >= 1, got -1"):
        Queue(capacity=-1)


def test_fields_added_in_another_order_stay_aligned_with_their_samples(q):
    c = q.client()
    idx = put_rows(c, "p", 4)
    c.put("p", {"y": torch.tensor([30.0, 20.0, 10.0, 0.0])}, indexes=idx[::-1])
    b = c.get("p", task="actor_train", batch_size=4, fields=["x", "y"], timeout=5)
    assert torch.equal(b.data["x"].squeeze(1) * 10, b.data["y"])


def test_a_batch_spanning_puts_and_units_is_assembled_in_order(q):
    c = q.client()
    for start in (0, 3, 6):  # three puts, placed on alternating storage units
        put_rows(c, "p", 3, start=start)
    b = c.get("p", task="actor_train", batch_size=9, fields=["x"], timeout=5)
    assert b.indexes == list(range(9))
    assert torch.equal(b.data["x"].squeeze(1), torch.arange(9.0))


def test_a_large_batch_gathered_from_several_puts_is_exact(q):
    c = q.client()
    puts = [torch.randn(256, 4096) for _ in range(4)]  # 16 MB: gathered by the bulk copy
    jagged = [torch.randn(int(n), 3) for n in torch.randint(1, 9000, (1024,))]
    for i, x in enumerate(puts):
        rows = jagged[i * 256 : (i + 1) * 256]
        c.put("p", {"x": x, "j": torch.nested.nested_tensor(rows, layout=torch.jagged)})
    b = c.get("p", task="actor_train", batch_size=1024, fields=["x", "j"], timeout=5)
    assert torch.equal(b.data["x"], torch.cat(puts))
    assert all(torch.equal(a, b) for a, b in zip(jagged, b.data["j"].unbind(), strict=True))


def test_string_fields_from_small_and_large_puts_come_back_in_order(q):
    c = q.client()
    small = ["a", "b"]
    large = [f"response {i} " * 100 for i in range(200)]  # > 64 KiB: stored packed
    c.put("p", {"s": small})
    c.put("p", {"s": large})
    b = c.get("p", task="actor_train", batch_size=202, fields=["s"], timeout=5)
    assert b.data["s"] == small + large


def test_jagged_fields_sliced_by_dp_ranks_and_joined_across_puts(q):
    c = q.client()
    rows = [torch.full((n, 2), float(n)) for n in (1, 4, 2, 3, 5, 6)]
    c.put("p", {"j": torch.nested.nested_tensor(rows[:3], layout=torch.jagged)})
    c.put("p", {"j": torch.nested.nested_tensor(rows[3:], layout=torch.jagged)})
    shares = [
        c.get("p", task="actor_train", batch_size=3, fields=["j"], dp_rank=r, dp_size=2, timeout=5)
        for r in (0, 1)
    ]
    got = [t for b in shares for t in b.data["j"].unbind()]
    assert all(torch.equal(a, b) for a, b in zip(rows, got, strict=True))
    whole = c.get("p", task="critic_train", batch_size=6, fields=["j"], timeout=5)
    assert whole.data["j"].layout == torch.jagged
    assert all(torch.equal(a, b) for a, b in zip(rows, whole.data["j"].unbind(), strict=True))


def test_a_put_copies_its_columns_so_later_writes_do_not_reach_consumers(q):
    c = q.client()
    dense = torch.arange(2 * 40_000, dtype=torch.float32).reshape(2, 40_000)  # big: copied early
    values = torch.arange(70_000, dtype=torch.float32)
    nested = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 30_000, 70_000]))
    words = ["a" * 70_000, "é" * 10]
    c.put("p", {"dense": dense, "nested": nested, "words": words})
    expected_dense, expected_values = dense.clone(), values.clone()
    dense.fill_(-1)
    values.fill_(-1)
    b = c.get("p", task="actor_train", batch_size=2, fields=["dense", "nested", "words"])
    assert torch.equal(b.data["dense"], expected_dense)
    assert torch.equal(b.data["nested"].values(), expected_values)
    assert b.data["nested"].offsets().tolist() == [0, 30_000, 70_000]
    assert b.data["words"] == words


def test_columns_built_in_shared_memory_are_put_without_a_copy(q):
    from rlferry.wire import pack_strings, shared_empty

    c = q.client()
    x = shared_empty([4, 8192], torch.float32)
    x.copy_(torch.arange(4 * 8192, dtype=torch.float32).reshape(4, 8192))
    words = [f"{i}" * 20_000 for i in range(4)]
    c.put("p", {"x": x, "words": pack_strings(words)})
    b = c.get("p", task="actor_train", batch_size=4, fields=["x", "words"])
    assert torch.equal(b.data["x"], x)
    x[0, 0] = -5.0  # the batch reads the very memory that was put: nothing was copied
    assert b.data["x"][0, 0].item() == -5.0
    assert b.data["words"] == words


def test_a_malformed_request_to_a_service_is_refused_by_name(q):
    from rlferry.wire import Client, RemoteError

    with Client(q.address) as raw:
        with pytest.raises(RemoteError) as e:
            raw.request("stats", timeout=10)
        assert e.value.kind == "SchemaError"
        assert e.value.message == (
            "request: expected a dict with `op`, got str (use rlferry's queue client)"
        )
        with pytest.raises(RemoteError) as e:
            raw.request({"op": "nope"}, timeout=10)
        assert e.value.message == (
            "request: op: expected one of ['ack', 'alloc', 'clear', 'dump', 'fields', "
            "'get', 'info', 'produced', 'release', 'stats'], got 'nope'"
        )
        assert raw.request({"op": "stats"}, timeout=10)["samples_held"] == 0
