"""verl 0.9.1 on `transfer_queue`: its replay buffer and its TransferQueue bridge, as its trainer
and agent loop call them.

Runs on rlferry's `rlferry.compat.transferqueue` (after `install()`, with Ray installed and never
started). With `RLFERRY_TQ_REAL=1` the same tests run on the real `transferqueue==0.1.11` on a
local Ray instead, in a venv of its own, which shows the tests themselves are right:

    .venv-tq/bin/pip install --no-deps verl==0.9.1
    .venv-tq/bin/pip install 'transformers<5.11' pillow codetiming orjson datasets cachetools \\
        uvicorn fastapi torchdata peft pytest pytest-timeout
    RLFERRY_TQ_REAL=1 .venv-tq/bin/python -m pytest -q -p no:cacheprovider tests/test_tq_verl.py

The paths driven: `ReplayBuffer.sample` (sync trainer), `ReplayBufferAsync.sample`,
`get_sampleable_count` and `wait_for_sampleable` (async trainer: staleness drop, failed groups,
DAPO filtering through `kv_batch_get(select_fields=["rm_scores"])` or the non-tensor
`extra_fields`; sampling in one thread while rollouts are written from another), and
`verl.utils.transferqueue_utils.tqbridge` (KVBatchMeta and BatchMeta in, sync and async
functions, from several threads at once). The data is written as verl's agent loop writes it:
prompts as tag-only keys, `async_kv_put` status updates, `async_kv_batch_put` trajectories.
While a sample waits for data, verl's replay buffer polls every `poll_interval` (its design).
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

REAL = os.environ.get("RLFERRY_TQ_REAL") == "1"

if not REAL:
    _shim = pytest.importorskip(
        "rlferry.compat.transferqueue",
        # ImportError too: a shim whose [tq] extra (tensordict, omegaconf) is missing says so.
        exc_type=ImportError,
        reason="rlferry.compat.transferqueue (issue 21) or its [tq] extra is not importable here",
    )
    _shim.install()

_VERL_MISSING = (
    "verl 0.9.1 is not installed (pip install --no-deps verl==0.9.1 plus the modules .ci/run "
    "installs in its verl venv)"
)
replay_buffer = pytest.importorskip("verl.trainer.ppo.v1.replay_buffer", reason=_VERL_MISSING)
tq_utils = pytest.importorskip("verl.utils.transferqueue_utils", reason=_VERL_MISSING)

import ray  # noqa: E402  (verl imports it; after the shim's install() on purpose)
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import NonTensorData, NonTensorStack, TensorDict  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run

# How long a test waits for work it started in another thread.
WAIT_S = 60


@pytest.fixture(scope="module")
def ray_for_real_tq():
    """The real TransferQueue runs on Ray: one local Ray for the module. The shim needs none."""
    if not REAL:
        yield
        return
    ray.init(address="local", num_cpus=16, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture
def queue(ray_for_real_tq):
    """A started `transfer_queue` (verl's trainer calls `tq.init()` once at start-up)."""
    tq.init()
    yield tq
    tq.close()


def _buffer(cls: type, **kwargs: Any) -> Any:
    config = {
        "trainer_mode": "sync" if cls is replay_buffer.ReplayBuffer else "async",
        "trainer_config": OmegaConf.create({}),
        "max_off_policy_threshold": None,
        "max_off_policy_strategy": "drop",
        "sampler_kwargs": OmegaConf.create({}),
        "poll_interval": 0.1,
    }
    config.update(kwargs)
    return cls(**config)


def _submit_prompts(uids: list[str], global_steps: int, partition_id: str = "train") -> None:
    """The trainer registers prompts as tag-only keys (`_submit_batch_to_rollout`)."""
    tags = [{"is_prompt": True, "status": "pending", "global_steps": global_steps} for _ in uids]
    tq.kv_batch_put(keys=uids, partition_id=partition_id, tags=tags)


async def _rollout(
    uid: str,
    n: int,
    global_steps: int,
    scores: list[float],
    status: str = "finished",
    partition_id: str = "train",
) -> None:
    """What verl's `AgentLoopWorkerTQ` writes for one prompt: running, n trajectories, terminal."""
    await tq.async_kv_put(key=uid, partition_id=partition_id, tag={"status": "running"})
    for session in range(n):
        base = int(uid.removeprefix("u")) * 100 + session * 10
        fields = TensorDict(
            {
                "prompts": torch.tensor([[base, base + 1]]),
                "responses": torch.tensor([[base + 2, base + 3, base + 4]]),
                "rm_scores": torch.tensor([[0.0, 0.0, scores[session]]]),
                "extra_fields": NonTensorStack.from_list(
                    [{"reward_extra_info": {"acc": scores[session]}}]
                ),
            },
            batch_size=1,
        )
        tags = [
            {
                "status": "success",
                "prompt_len": 2,
                "response_len": 3,
                "seq_len": 5,
                "global_steps": global_steps,
            }
        ]
        await tq.async_kv_batch_put(
            keys=[f"{uid}_{session}_0"], fields=fields, tags=tags, partition_id=partition_id
        )
    await tq.async_kv_put(key=uid, partition_id=partition_id, tag={"status": status})


def _produce(*rollouts: Any) -> None:
    asyncio.run(_gather(*rollouts))


async def _gather(*rollouts: Any) -> None:
    await asyncio.gather(*rollouts)


def test_sync_replay_buffer_samples_finished_groups_and_clears_their_prompts(queue):
    _submit_prompts(["u1", "u2", "u3"], global_steps=1)
    _produce(_rollout("u1", 2, 1, [1.0, 0.0]), _rollout("u2", 2, 1, [0.0, 1.0]))
    buffer = _buffer(replay_buffer.ReplayBuffer)

    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=2)

    assert isinstance(batch, tq.KVBatchMeta)
    assert batch.partition_id == "train"
    assert sorted(batch.keys) == ["u1_0_0", "u1_1_0", "u2_0_0", "u2_1_0"]
    assert all(tag["status"] == "success" and tag["seq_len"] == 5 for tag in batch.tags)
    assert metrics == {}
    # The selected prompts are cleared; the one still pending stays.
    listed = tq.kv_list("train")["train"]
    assert sorted(listed) == ["u1_0_0", "u1_1_0", "u2_0_0", "u2_1_0", "u3"]
    # The trainer then reads the batch's fields and clears it.
    data = tq.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=["responses"]
    )
    by_key = dict(
        zip(batch.keys, [row.tolist() for row in data["responses"].unbind(0)], strict=True)
    )
    assert by_key == {
        "u1_0_0": [102, 103, 104],
        "u1_1_0": [112, 113, 114],
        "u2_0_0": [202, 203, 204],
        "u2_1_0": [212, 213, 214],
    }
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
    assert tq.kv_list("train") == {
        "train": {"u3": {"is_prompt": True, "status": "pending", "global_steps": 1}}
    }


def test_sync_replay_buffer_samples_the_validation_partition(queue):
    _submit_prompts(["u4"], global_steps=2, partition_id="val")
    _produce(_rollout("u4", 1, 2, [1.0], partition_id="val"))

    batch, _ = _buffer(replay_buffer.ReplayBuffer).sample(
        global_steps=2, partition_id="val", batch_size=1
    )

    assert (batch.partition_id, batch.keys) == ("val", ["u4_0_0"])
    # The sampled KVBatchMeta names no fields: the trainer selects them by name.
    data = tq.kv_batch_get(keys=batch.keys, partition_id="val", select_fields=["rm_scores"])
    assert data["rm_scores"].unbind(0)[0].tolist() == [0.0, 0.0, 1.0]


def test_async_replay_buffer_drops_stale_and_failed_groups_and_refills(queue):
    _submit_prompts(["u1"], global_steps=1)
    _submit_prompts(["u2", "u3"], global_steps=3)
    _produce(
        _rollout("u1", 2, 1, [1.0, 0.0]),
        _rollout("u2", 2, 3, [1.0, 0.0]),
        _rollout("u3", 1, 3, [1.0], status="failure"),
    )
    refills: list[int] = []
    buffer = _buffer(
        replay_buffer.ReplayBufferAsync, max_off_policy_threshold=1, refill_fn=refills.append
    )

    assert buffer.get_sampleable_count(global_steps=3, partition_id="train") == 1
    batch, metrics = buffer.sample(global_steps=3, partition_id="train", batch_size=1)

    assert sorted(batch.keys) == ["u2_0_0", "u2_1_0"]
    assert refills == [2]
    assert metrics["training/off_policy/evicted_samples"] == 1
    assert metrics["training/rollout_failure/evicted_samples"] == 1
    # The stale and the failed groups are gone with their trajectories; u2's prompt is consumed.
    assert sorted(tq.kv_list("train")["train"]) == ["u2_0_0", "u2_1_0"]


def test_async_replay_buffer_filters_groups_whose_rewards_are_all_equal(queue):
    _submit_prompts(["u1", "u2"], global_steps=1)
    _produce(_rollout("u1", 2, 1, [1.0, 1.0]), _rollout("u2", 2, 1, [0.0, 1.0]))
    refills: list[int] = []
    buffer = _buffer(
        replay_buffer.ReplayBufferAsync, filter_groups_metric="reward", refill_fn=refills.append
    )

    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=1)

    assert sorted(batch.keys) == ["u2_0_0", "u2_1_0"]
    assert refills == [1]
    assert metrics["training/filter_groups/evicted_samples"] == 1
    assert metrics[replay_buffer.DAPO_FILTERED_REWARD_COUNTS_KEY] == {1.0: 1}


def test_async_replay_buffer_filters_groups_by_a_reward_extra_info_metric(queue):
    """The DAPO metric read from each trajectory's `extra_fields` (a non-tensor field)."""
    _submit_prompts(["u1", "u2", "u3"], global_steps=1)
    _produce(
        _rollout("u1", 2, 1, [0.0, 0.0]),
        _rollout("u2", 2, 1, [0.0, 1.0]),
        _rollout("u3", 3, 1, [1.0, 0.0, 1.0]),
    )
    refills: list[int] = []
    buffer = _buffer(
        replay_buffer.ReplayBufferAsync, filter_groups_metric="acc", refill_fn=refills.append
    )

    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=2)

    assert sorted(batch.keys) == ["u2_0_0", "u2_1_0", "u3_0_0", "u3_1_0", "u3_2_0"]
    assert refills == [1]
    assert metrics[replay_buffer.DAPO_FILTERED_REWARD_COUNTS_KEY] == {0.0: 1}


def test_async_replay_buffer_sample_waits_for_groups_produced_by_another_thread(queue):
    """The separate-async trainer samples while agent-loop workers still write."""
    _submit_prompts(["u1", "u2"], global_steps=1)
    buffer = _buffer(replay_buffer.ReplayBufferAsync)
    with ThreadPoolExecutor(max_workers=1) as pool:
        sampled = pool.submit(buffer.sample, global_steps=1, partition_id="train", batch_size=2)
        _produce(_rollout("u1", 2, 1, [1.0, 0.0]), _rollout("u2", 3, 1, [0.0, 1.0, 0.0]))
        batch, _ = sampled.result(timeout=WAIT_S)
    assert sorted(batch.keys) == ["u1_0_0", "u1_1_0", "u2_0_0", "u2_1_0", "u2_2_0"]


def _kv_batch(keys: list[str], start: int) -> Any:
    fields = TensorDict(
        {"responses": torch.arange(start, start + 3 * len(keys)).reshape(len(keys), 3)},
        batch_size=len(keys),
    )
    tags = [{"status": "success", "n": i} for i in range(len(keys))]
    return tq.kv_batch_put(keys=keys, partition_id="train", fields=fields, tags=tags)


def _double(data: TensorDict) -> TensorDict:
    """A worker method: reads `responses`, returns `values` and a batch-level NonTensorData."""
    out = TensorDict({"values": data["responses"].float() * 2}, batch_size=data.batch_size)
    out["note"] = NonTensorData("doubled")
    return out


def test_tqbridge_reads_a_kv_batch_and_writes_the_output_back(queue):
    batch = _kv_batch(["a", "b"], start=0)
    batch.extra_info = {"temperature": 1.0}

    result = tq_utils.tqbridge()(_double)(batch)

    assert isinstance(result, tq.KVBatchMeta)
    assert result.keys == ["a", "b"]
    assert result.tags == [{"status": "success", "n": 0}, {"status": "success", "n": 1}]
    assert sorted(result.fields) == ["responses", "values"]
    assert result.extra_info == {"note": "doubled"}
    values = tq.kv_batch_get(keys=["b", "a"], partition_id="train", select_fields="values")[
        "values"
    ]
    assert [row.tolist() for row in values.unbind(0)] == [[6.0, 8.0, 10.0], [0.0, 2.0, 4.0]]


def test_tqbridge_async_function_with_a_batch_meta(queue):
    client = tq.get_client()
    client.put(
        data=TensorDict({"responses": torch.arange(6).reshape(2, 3)}, batch_size=2),
        partition_id="p",
    )
    meta = client.get_meta(
        data_fields=["responses"], batch_size=2, partition_id="p", task_name="actor"
    )

    async def double(data: TensorDict) -> TensorDict:
        return _double(data)

    result = asyncio.run(tq_utils.tqbridge()(double)(meta))

    assert isinstance(result, tq.BatchMeta)
    assert result.field_names == ["responses", "values"]
    assert result.extra_info == {"note": "doubled"}
    data = client.get_data(result.select_fields(["values"]))
    assert [row.tolist() for row in data["values"].unbind(0)] == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]


def test_tqbridge_from_several_threads_at_once(queue):
    batches = [_kv_batch([f"t{t}_{i}" for i in range(4)], start=100 * t) for t in range(4)]
    bridged = tq_utils.tqbridge()(_double)
    start = threading.Barrier(len(batches))

    def run(batch: Any) -> Any:
        start.wait(timeout=WAIT_S)
        return bridged(batch)

    with ThreadPoolExecutor(max_workers=len(batches)) as pool:
        results = [
            future.result(timeout=WAIT_S) for future in [pool.submit(run, b) for b in batches]
        ]

    for t, result in enumerate(results):
        assert result.keys == [f"t{t}_{i}" for i in range(4)]
        values = tq.kv_batch_get_by_meta(result, select_fields=["values"])["values"]
        expected = (torch.arange(100 * t, 100 * t + 12).reshape(4, 3).float() * 2).tolist()
        assert [row.tolist() for row in values.unbind(0)] == expected


@pytest.mark.skipif(REAL, reason="the real TransferQueue needs a running Ray")
def test_ray_is_installed_and_never_started():
    if ray.is_initialized():
        pytest.skip("another test of this session started Ray")
    tq.init()
    try:
        _submit_prompts(["u1"], global_steps=1)
        _produce(_rollout("u1", 1, 1, [1.0]))
        batch, _ = _buffer(replay_buffer.ReplayBuffer).sample(
            global_steps=1, partition_id="train", batch_size=1
        )
        assert batch.keys == ["u1_0_0"]
        assert not ray.is_initialized()
    finally:
        tq.close()
