"""Scenarios run through the `transfer_queue` public API, for the differential tests.

Each scenario takes the imported `transfer_queue` module (the real `transferqueue==0.1.11`
package, or rlferry's `rlferry.compat.transferqueue` after `install()`), starts it with
`tq.init(...)`, drives it as a framework does, closes it, and returns a JSON-able record of
everything it saw. `record.py` writes the records of the real package to `golden.json`;
`tests/test_tq_differential.py` compares rlferry's records with them field by field.

Scenarios use only the public API (`transfer_queue.__all__`, the client's public methods,
`BatchMeta`/`KVBatchMeta` methods). Exceptions are compared by their built-in type
(`records.error_name`); messages may differ.
"""

from __future__ import annotations

import asyncio
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from tensordict import NonTensorStack, TensorDict

from . import records as rec
from .records import outcome, running


def _conf(**controller: Any) -> Any:
    """A TransferQueue configuration with these controller entries (samplers are objects)."""
    return OmegaConf.create({"controller": controller}, flags={"allow_objects": True})


def _prompts(n: int) -> TensorDict:
    """`n` samples: an int64 [n, 3] `prompt`, a float32 [n, 2] `score` and a string `text`."""
    ids = torch.arange(n, dtype=torch.int64)
    return TensorDict(
        {
            "prompt": torch.stack([ids * 10, ids * 10 + 1, ids * 10 + 2], dim=1),
            "score": torch.stack([ids.float() / 2, -ids.float()], dim=1),
            "text": NonTensorStack(*[f"prompt {i}" for i in ids.tolist()]),
        },
        batch_size=n,
    )


def _column(name: str, values: list[int]) -> TensorDict:
    """One int64 field of shape [len(values), 1]."""
    return TensorDict({name: torch.tensor(values).unsqueeze(1)}, batch_size=len(values))


def kv_roundtrip(tq: Any) -> dict:
    """kv_batch_put / kv_put / kv_batch_get / kv_batch_get_by_meta / kv_list / kv_clear."""
    out: dict[str, Any] = {}
    with running(tq):
        keys = ["k0", "k1", "k2", "k3"]
        tags = [{"step": i, "status": "done"} for i in range(4)]
        meta = tq.kv_batch_put(keys=keys, partition_id="train", fields=_prompts(4), tags=tags)
        out["batch_put"] = rec.kv_meta(meta)
        out["list_partition"] = tq.kv_list(partition_id="train")
        out["get_all"] = rec.tensordict(tq.kv_batch_get(keys=keys, partition_id="train"))
        out["get_reordered"] = rec.tensordict(
            tq.kv_batch_get(keys=["k3", "k0"], partition_id="train")
        )
        out["get_one_key_as_str"] = rec.tensordict(tq.kv_batch_get(keys="k2", partition_id="train"))
        out["get_field_as_str"] = rec.tensordict(
            tq.kv_batch_get(keys=keys, partition_id="train", select_fields="score")
        )
        out["get_field_list"] = rec.tensordict(
            tq.kv_batch_get(
                keys=["k1", "k2"], partition_id="train", select_fields=["text", "prompt"]
            )
        )
        out["get_by_meta"] = rec.tensordict(tq.kv_batch_get_by_meta(meta))
        out["get_by_meta_select"] = rec.tensordict(
            tq.kv_batch_get_by_meta(meta, select_fields=["score"])
        )

        single = tq.kv_put(
            key="k4",
            partition_id="train",
            fields={"prompt": torch.tensor([40, 41, 42]), "score": torch.tensor([2.0, -4.0])},
            tag={"step": 4},
        )
        out["put_single"] = rec.kv_meta(single)
        out["get_single"] = rec.tensordict(tq.kv_batch_get(keys="k4", partition_id="train"))
        retag = tq.kv_put(key="k1", partition_id="train", tag={"status": "stale", "extra": True})
        out["put_tag_only"] = rec.kv_meta(retag)
        out["list_after_retag"] = tq.kv_list(partition_id="train")
        out["get_after_retag"] = rec.tensordict(tq.kv_batch_get(keys="k1", partition_id="train"))
        tq.kv_put(key="v0", partition_id="val", tag={"is_prompt": True})
        out["list_all"] = tq.kv_list()

        tq.kv_clear(keys="k0", partition_id="train")
        tq.kv_clear(keys=["k2", "k3"], partition_id="train")
        out["list_after_clear"] = tq.kv_list(partition_id="train")
        out["get_cleared"] = outcome(lambda: tq.kv_batch_get(keys="k0", partition_id="train"))
        out["clear_unknown_key"] = outcome(lambda: tq.kv_clear(keys="nope", partition_id="train"))
        out["list_unknown_partition"] = tq.kv_list(partition_id="nowhere")
    return out


def kv_jagged(tq: Any) -> dict:
    """Jagged (nested) fields by kv_batch_put, and samples of different lengths across puts."""
    out: dict[str, Any] = {}
    with running(tq):
        jagged = torch.nested.nested_tensor(
            [torch.arange(3), torch.arange(5) + 10, torch.arange(1) + 20], layout=torch.jagged
        )
        fields = TensorDict(
            {"response": jagged, "reward": torch.tensor([0.5, 1.0, -1.0])}, batch_size=3
        )
        out["put"] = rec.kv_meta(
            tq.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields=fields)
        )
        out["get"] = rec.tensordict(tq.kv_batch_get(keys=["a", "b", "c"], partition_id="p"))
        out["get_middle"] = rec.tensordict(tq.kv_batch_get(keys=["b"], partition_id="p"))
        longer = TensorDict(
            {"response": torch.arange(7).unsqueeze(0) + 30, "reward": torch.tensor([2.0])},
            batch_size=1,
        )
        tq.kv_batch_put(keys=["d"], partition_id="p", fields=longer)
        out["get_mixed_lengths"] = rec.tensordict(
            tq.kv_batch_get(keys=["c", "d", "a"], partition_id="p")
        )
        out["put_nested_by_kv_put"] = outcome(
            lambda: tq.kv_put(
                key="e",
                partition_id="p",
                fields={
                    "response": torch.nested.nested_tensor([torch.arange(2)], layout=torch.jagged)
                },
            )
        )
    return out


def kv_prompt_groups(tq: Any) -> dict:
    """verl's replay buffer: prompts as tag-only keys, trajectories as `uid_session_index`."""
    out: dict[str, Any] = {}
    with running(tq):
        uids = ["u0", "u1"]
        prompt_tags = [{"is_prompt": True, "status": "pending", "global_steps": 1} for _ in uids]
        out["put_prompts"] = rec.kv_meta(
            tq.kv_batch_put(keys=uids, partition_id="train", tags=prompt_tags)
        )
        out["get_tag_only_key"] = outcome(lambda: tq.kv_batch_get(keys="u0", partition_id="train"))
        tq.kv_put(key="u0", partition_id="train", tag={"status": "running"})
        trajectories = ["u0_0_0", "u0_1_0"]
        fields = TensorDict(
            {
                "responses": torch.tensor([[1, 2], [3, 4]]),
                "rm_scores": torch.tensor([[0.0, 1.0], [0.0, 1.0]]),
            },
            batch_size=2,
        )
        traj_tags = [{"status": "success", "global_steps": 1, "seq_len": 4} for _ in trajectories]
        out["put_trajectories"] = rec.kv_meta(
            tq.kv_batch_put(keys=trajectories, partition_id="train", fields=fields, tags=traj_tags)
        )
        tq.kv_put(key="u0", partition_id="train", tag={"status": "finished"})
        out["list"] = tq.kv_list("train")
        out["get_scores"] = rec.tensordict(
            tq.kv_batch_get(keys=trajectories, partition_id="train", select_fields=["rm_scores"])
        )
        out["fields_added_to_tagged_key"] = rec.kv_meta(
            tq.kv_batch_put(keys=["u1"], partition_id="train", fields=_column("raw", [7]))
        )
        out["list_after_fields"] = tq.kv_list("train")
        tq.kv_clear(partition_id="train", keys=["u0", *trajectories])
        out["list_after_clear"] = tq.kv_list()
    return out


def native_by_task(tq: Any) -> dict:
    """put -> get_meta -> get_data by task name; consumption, production and reset."""
    out: dict[str, Any] = {}
    with running(tq) as client:
        meta = client.put(data=_prompts(6), partition_id="train")
        out["put"] = rec.batch_meta(meta)
        out["put_types"] = rec.field_types(meta)
        fields = ["prompt", "score"]
        first = client.get_meta(
            data_fields=fields, batch_size=2, partition_id="train", task_name="gen"
        )
        second = client.get_meta(
            data_fields=fields, batch_size=3, partition_id="train", task_name="gen"
        )
        out["gen_first"] = rec.batch_meta(first)
        out["gen_second"] = rec.batch_meta(second)
        out["gen_first_data"] = rec.tensordict(client.get_data(first))
        out["gen_second_data"] = rec.tensordict(client.get_data(second))
        out["consumption_gen"] = rec.status(client.get_consumption_status("gen", "train"))
        out["consumed_all_gen"] = bool(client.check_consumption_status("gen", "train"))
        other = client.get_meta(
            data_fields=["text"], batch_size=6, partition_id="train", task_name="log"
        )
        out["log_all"] = rec.batch_meta(other)
        out["log_all_data"] = rec.tensordict(client.get_data(other))
        out["consumed_all_log"] = bool(client.check_consumption_status("log", "train"))
        out["production"] = rec.status(client.get_production_status(fields, "train"))
        out["produced"] = bool(client.check_production_status(fields, "train"))
        out["produced_missing_field"] = bool(client.check_production_status(["nope"], "train"))
        out["reset_gen"] = bool(client.reset_consumption("train", task_name="gen"))
        again = client.get_meta(
            data_fields=fields, batch_size=2, partition_id="train", task_name="gen"
        )
        out["gen_after_reset"] = rec.batch_meta(again)
        forced = client.get_meta(
            data_fields=fields,
            batch_size=6,
            partition_id="train",
            task_name="gen",
            mode="force_fetch",
        )
        out["force_fetch"] = rec.batch_meta(forced)
        out["reset_all"] = bool(client.reset_consumption("train"))
        out["consumption_log_after_reset"] = rec.status(
            client.get_consumption_status("log", "train")
        )
    return out


def native_put_with_meta(tq: Any) -> dict:
    """A consumer writes a new field for the samples it fetched (put with `metadata=`)."""
    out: dict[str, Any] = {}
    with running(tq) as client:
        client.put(data=_prompts(4), partition_id="train")
        meta = client.get_meta(
            data_fields=["prompt"], batch_size=4, partition_id="train", task_name="gen"
        )
        first_two = meta.select_samples([0, 1])
        written = client.put(data=_column("response", [100, 101]), metadata=first_two)
        out["put_response"] = rec.batch_meta(written)
        out["production_response"] = rec.status(client.get_production_status(["response"], "train"))
        ready = client.get_meta(
            data_fields=["prompt", "response"],
            batch_size=2,
            partition_id="train",
            task_name="train",
        )
        out["train_ready"] = rec.batch_meta(ready)
        out["train_ready_data"] = rec.tensordict(client.get_data(ready))
        rest = client.put(
            data=_column("response", [102, 103]), metadata=meta.select_samples([2, 3])
        )
        out["put_rest"] = rec.batch_meta(rest)
        late = client.get_meta(
            data_fields=["prompt", "response"],
            batch_size=2,
            partition_id="train",
            task_name="train",
        )
        out["train_late_data"] = rec.tensordict(client.get_data(late))
        out["get_data_selected_field"] = rec.tensordict(
            client.get_data(late.select_fields(["response"]))
        )
    return out


def grpo_groups(tq: Any) -> dict:
    """GRPOGroupNSampler hands out whole groups of `n_samples_per_prompt` consecutive samples."""
    out: dict[str, Any] = {}
    with running(tq, _conf(sampler=tq.GRPOGroupNSampler(n_samples_per_prompt=2))) as client:
        client.put(data=_prompts(8), partition_id="train")
        everything = client.get_meta(
            data_fields=["prompt"],
            batch_size=8,
            partition_id="train",
            task_name="all",
            mode="force_fetch",
        )
        # Rewards for groups 0 and 2, and for one sample of group 1.
        client.put(
            data=_column("reward", [1, 1, 0, 0, 0]),
            metadata=everything.select_samples([0, 1, 2, 4, 5]),
        )
        fields = ["prompt", "reward"]
        whole = client.get_meta(
            data_fields=fields, batch_size=4, partition_id="train", task_name="train"
        )
        out["complete_groups"] = rec.batch_meta(whole)
        out["complete_groups_data"] = rec.tensordict(client.get_data(whole))
        client.put(data=_column("reward", [1, 1, 1]), metadata=everything.select_samples([3, 6, 7]))
        late = client.get_meta(
            data_fields=fields, batch_size=4, partition_id="train", task_name="train"
        )
        out["late_groups"] = rec.batch_meta(late)
        client.reset_consumption("train")
        out["batch_not_multiple_of_n"] = outcome(
            lambda: client.get_meta(
                data_fields=fields, batch_size=3, partition_id="train", task_name="odd"
            )
        )
    return out


def rank_aware_dp(tq: Any) -> dict:
    """RankAwareSampler: ranks of one data-parallel group get the same samples, groups differ.

    Ten samples for eight handed out: TransferQueue checks that enough unconsumed samples are
    ready before it asks the sampler, also for a rank whose batch is cached.
    """
    out: dict[str, Any] = {}
    with running(tq, _conf(sampler=tq.RankAwareSampler())) as client:
        client.put(data=_prompts(10), partition_id="train")
        seen = {}
        for batch_index in (0, 1):
            for rank, dp_rank in enumerate([0, 0, 1, 1]):
                meta = client.get_meta(
                    data_fields=["prompt"],
                    batch_size=2,
                    partition_id="train",
                    task_name="actor",
                    # As StreamingDataset sends it: the sampler reads the task and partition here.
                    sampling_config={
                        "dp_rank": dp_rank,
                        "batch_index": batch_index,
                        "task_name": "actor",
                        "partition_id": "train",
                    },
                )
                seen[f"batch{batch_index}_rank{rank}"] = {
                    "meta": rec.batch_meta(meta),
                    "data": rec.tensordict(client.get_data(meta)),
                }
        out["ranks"] = seen
        out["consumption"] = rec.status(client.get_consumption_status("actor", "train"))
    return out


def custom_meta(tq: Any) -> dict:
    """Per-sample custom meta set on a BatchMeta travels to later get_meta calls and kv_list."""
    out: dict[str, Any] = {}
    with running(tq) as client:
        meta = client.put(data=_prompts(3), partition_id="train")
        meta.update_custom_meta([{"uid": "a", "n": 0}, {"uid": "b", "n": 1}, {"uid": "c", "n": 2}])
        client.set_custom_meta(meta)
        fetched = client.get_meta(
            data_fields=["prompt"], batch_size=3, partition_id="train", task_name="t"
        )
        out["fetched"] = rec.batch_meta(fetched)
        fetched.update_custom_meta([{"n": 10}, {"n": 11}, {"n": 12}])
        client.put(data=_column("reward", [5, 6, 7]), metadata=fetched)
        again = client.get_meta(
            data_fields=["prompt", "reward"], batch_size=3, partition_id="train", task_name="u"
        )
        out["after_put_with_custom_meta"] = rec.batch_meta(again)
        out["kv_list"] = tq.kv_list("train")
        extra = again.select_samples([1])
        extra.set_extra_info("step", 3)
        extra.update_extra_info({"source": "rollout"})
        out["extra_info"] = rec.batch_meta(extra)
        out["extra_info_get"] = [extra.get_extra_info("step"), extra.has_extra_info("missing")]
    return out


def partitions(tq: Any) -> dict:
    """Partitions: get_partition_list, clear_partition (also once its keys are cleared), reuse."""
    out: dict[str, Any] = {}
    with running(tq) as client:
        tq.kv_batch_put(keys=["a0", "a1"], partition_id="a", fields=_column("x", [1, 2]))
        tq.kv_batch_put(keys=["b0"], partition_id="b", tags=[{"t": 1}])
        client.put(data=_column("x", [3, 4, 5]), partition_id="c")
        out["partitions"] = client.get_partition_list()
        client.clear_partition("a")
        out["partitions_after_clear_a"] = client.get_partition_list()
        out["kv_list_after_clear_a"] = tq.kv_list()
        out["get_from_cleared"] = outcome(lambda: tq.kv_batch_get(keys="a0", partition_id="a"))
        tq.kv_clear(keys="b0", partition_id="b")
        out["kv_list_after_kv_clear_b"] = tq.kv_list()
        client.clear_partition("b")
        out["partitions_after_clear_b"] = client.get_partition_list()
        out["kv_list_after_clear_b"] = tq.kv_list()
        out["clear_unknown_partition"] = outcome(lambda: client.clear_partition("never"))
        reused = client.put(data=_column("x", [6, 7]), partition_id="d")
        # Freed global indexes are reused; which freed index goes first is the order of a set
        # inside TransferQueue's controller, so the record keeps them sorted.
        out["reused_indexes_sorted"] = sorted(int(i) for i in reused.global_indexes)
        tq.kv_put(key="a0", partition_id="a", fields={"x": torch.tensor([9])})
        out["partition_recreated"] = rec.tensordict(tq.kv_batch_get(keys="a0", partition_id="a"))
        c_meta = client.get_meta(data_fields=["x"], batch_size=3, partition_id="c", task_name="t")
        out["c_untouched"] = rec.tensordict(client.get_data(c_meta))
    return out


def checkpoints(tq: Any) -> dict:
    """save_checkpoint / load_checkpoint across a close() and a fresh init()."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        with running(tq) as client:
            tq.kv_batch_put(
                keys=["k0", "k1"],
                partition_id="train",
                fields=_prompts(2),
                tags=[{"status": "finished"}, {"status": "running"}],
            )
            client.put(data=_column("x", [1, 2, 3, 4]), partition_id="native")
            client.get_meta(data_fields=["x"], batch_size=2, partition_id="native", task_name="t")
            tq.save_checkpoint(ckpt, metadata={"step": 3})
            out["files_saved"] = ckpt.is_dir()
            tq.kv_clear(keys="k1", partition_id="train")
            out["list_before_load"] = tq.kv_list()
        with running(tq) as client:
            out["list_fresh"] = tq.kv_list()
            tq.load_checkpoint(str(ckpt))
            out["list_loaded"] = tq.kv_list()
            out["get_loaded"] = rec.tensordict(
                tq.kv_batch_get(keys=["k1", "k0"], partition_id="train")
            )
            rest = client.get_meta(
                data_fields=["x"], batch_size=2, partition_id="native", task_name="t"
            )
            out["consumption_restored"] = rec.batch_meta(rest)
            out["consumption_restored_data"] = rec.tensordict(client.get_data(rest))
            out["partitions_loaded"] = sorted(client.get_partition_list())
            out["load_missing"] = outcome(lambda: tq.load_checkpoint(Path(tmp) / "missing"))
        out["save_after_close"] = outcome(lambda: tq.save_checkpoint(Path(tmp) / "late"))
    return out


def async_twins(tq: Any) -> dict:
    """The `async_` KV functions and the client's `async_` methods, on the caller's event loop."""

    async def main(client: Any) -> dict:
        out: dict[str, Any] = {}
        meta = await tq.async_kv_batch_put(
            keys=["k0", "k1"], partition_id="train", fields=_prompts(2), tags=[{"i": 0}, {"i": 1}]
        )
        out["batch_put"] = rec.kv_meta(meta)
        single = await tq.async_kv_put(
            key="k2", partition_id="train", fields={"prompt": torch.tensor([7, 8, 9])}
        )
        out["put"] = rec.kv_meta(single)
        await asyncio.gather(
            *(
                tq.async_kv_put(
                    key=f"c{i}", partition_id="conc", fields={"v": torch.tensor([i])}, tag={"i": i}
                )
                for i in range(4)
            )
        )
        listed = await tq.async_kv_list("conc")
        # Concurrent puts land in whatever order their requests reach the controller: the record
        # keeps the listing sorted by key.
        out["list_concurrent_sorted"] = {
            pid: dict(sorted(keys.items())) for pid, keys in listed.items()
        }
        got = await tq.async_kv_batch_get(keys=["c3", "c0"], partition_id="conc")
        out["get_concurrent"] = rec.tensordict(got)
        out["get"] = rec.tensordict(await tq.async_kv_batch_get(keys=["k1"], partition_id="train"))
        out["get_by_meta"] = rec.tensordict(
            await tq.async_kv_batch_get_by_meta(meta, select_fields="score")
        )
        await tq.async_kv_clear(keys=["k0"], partition_id="train")
        out["list_after_clear"] = await tq.async_kv_list()

        put_meta = await client.async_put(data=_column("x", [5, 6, 7]), partition_id="native")
        out["client_put"] = rec.batch_meta(put_meta)
        fetched = await client.async_get_meta(
            data_fields=["x"], batch_size=2, partition_id="native", task_name="t"
        )
        out["client_get_meta"] = rec.batch_meta(fetched)
        out["client_get_data"] = rec.tensordict(await client.async_get_data(fetched))
        out["client_partitions"] = await client.async_get_partition_list()
        out["client_consumed"] = rec.status(
            await client.async_get_consumption_status("t", "native")
        )
        await client.async_clear_samples(fetched)
        out["client_partitions_after_clear_samples"] = rec.status(
            await client.async_get_production_status(["x"], "native")
        )
        await client.async_clear_partition("native")
        out["client_partitions_after_clear"] = await client.async_get_partition_list()
        return out

    with running(tq) as client:
        return asyncio.run(main(client))


def pickled_meta(tq: Any) -> dict:
    """BatchMeta and KVBatchMeta survive pickling (frameworks broadcast them between ranks)."""
    out: dict[str, Any] = {}
    with running(tq) as client:
        client.put(data=_prompts(3), partition_id="train")
        meta = client.get_meta(
            data_fields=["prompt", "text"], batch_size=3, partition_id="train", task_name="t"
        )
        meta.update_custom_meta([{"uid": i} for i in range(3)])
        meta.set_extra_info("step", 1)
        copy = pickle.loads(pickle.dumps(meta))
        out["batch_meta"] = rec.batch_meta(copy)
        out["batch_meta_equal_record"] = rec.batch_meta(copy) == rec.batch_meta(meta)
        out["batch_meta_data"] = rec.tensordict(client.get_data(copy))
        out["empty_batch_meta"] = rec.batch_meta(pickle.loads(pickle.dumps(tq.BatchMeta.empty())))

        kv = tq.kv_batch_put(
            keys=["a", "b"], partition_id="kv", fields=_prompts(2), tags=[{"x": 1}, {"x": 2}]
        )
        kv_copy = pickle.loads(pickle.dumps(kv))
        out["kv_meta"] = rec.kv_meta(kv_copy)
        out["kv_meta_data"] = rec.tensordict(
            tq.kv_batch_get_by_meta(kv_copy, select_fields=["prompt"])
        )
        built = tq.KVBatchMeta(keys=["b"], tags=[{}], partition_id="kv", fields=["score"])
        out["kv_meta_built_data"] = rec.tensordict(
            tq.kv_batch_get_by_meta(pickle.loads(pickle.dumps(built)))
        )
    return out


def meta_methods(tq: Any) -> dict:
    """BatchMeta and KVBatchMeta methods on metas the queue returned."""
    out: dict[str, Any] = {}
    with running(tq) as client:
        client.put(data=_prompts(5), partition_id="train")
        meta = client.get_meta(
            data_fields=["prompt"], batch_size=5, partition_id="train", task_name="t"
        )
        meta.update_custom_meta([{"i": i} for i in range(5)])
        out["chunk"] = [rec.batch_meta(part) for part in meta.chunk(2)]
        out["concat"] = rec.batch_meta(tq.BatchMeta.concat(meta.chunk(3)))
        out["select_samples"] = rec.batch_meta(meta.select_samples([4, 0]))
        out["getitem_int"] = rec.batch_meta(meta[1])
        out["getitem_slice"] = rec.batch_meta(meta[1:3])
        scores = client.get_meta(
            data_fields=["score"], batch_size=5, partition_id="train", task_name="u"
        )
        out["union"] = rec.batch_meta(meta.union(scores))
        out["select_fields"] = rec.batch_meta(meta.union(scores).select_fields(["score"]))
        reordered = meta.select_samples([0, 1, 2, 3, 4])
        reordered.reorder([4, 3, 2, 1, 0])
        out["reorder"] = rec.batch_meta(reordered)
        out["reorder_data"] = rec.tensordict(client.get_data(reordered))
        out["reorder_duplicate"] = outcome(lambda: meta.select_samples([0, 1]).reorder([0, 0]))
        out["empty"] = rec.batch_meta(tq.BatchMeta.empty(extra_info={"k": 1}))

        kv = tq.kv_batch_put(
            keys=["a", "b", "c"], partition_id="kv", tags=[{"n": 0}, {"n": 1}, {"n": 2}]
        )
        out["kv_chunk"] = [rec.kv_meta(part) for part in kv.chunk(2)]
        out["kv_concat"] = rec.kv_meta(tq.KVBatchMeta.concat(kv.chunk(3)))
        out["kv_select_keys"] = rec.kv_meta(kv.select_keys(["c", "a"]))
        out["kv_select_missing"] = outcome(lambda: kv.select_keys(["z"]))
        flipped = tq.KVBatchMeta(keys=list(kv.keys), tags=list(kv.tags), partition_id="kv")
        flipped.reorder([2, 0, 1])
        out["kv_reorder"] = rec.kv_meta(flipped)
        out["kv_duplicate_keys"] = outcome(lambda: tq.KVBatchMeta(keys=["a", "a"], tags=[{}, {}]))
        out["kv_tag_count_mismatch"] = outcome(lambda: tq.KVBatchMeta(keys=["a"], tags=[]))
    return out


def bad_inputs(tq: Any) -> dict:
    """Mistakes users make, answered at once: the exception types must match."""
    out: dict[str, Any] = {}
    with running(tq) as client:
        tq.kv_batch_put(keys=["full", "half"], partition_id="train", fields=_column("a", [1, 2]))
        tq.kv_put(key="full", partition_id="train", fields={"b": torch.tensor([3])})
        out["field_missing_from_some_keys"] = outcome(
            lambda: tq.kv_batch_get(
                keys=["full", "half"], partition_id="train", select_fields=["a", "b"]
            )
        )
        out["common_fields_only"] = outcome(
            lambda: tq.kv_batch_get(keys=["full", "half"], partition_id="train"), rec.tensordict
        )
        out["unknown_field"] = outcome(
            lambda: tq.kv_batch_get(keys=["full"], partition_id="train", select_fields=["zzz"])
        )
        out["unknown_key"] = outcome(lambda: tq.kv_batch_get(keys=["nope"], partition_id="train"))
        out["some_keys_unknown"] = outcome(
            lambda: tq.kv_batch_get(keys=["full", "nope"], partition_id="train"), rec.tensordict
        )
        out["wrong_partition"] = outcome(lambda: tq.kv_batch_get(keys=["full"], partition_id="val"))
        out["empty_key_list"] = outcome(lambda: tq.kv_batch_get(keys=[], partition_id="train"))
        out["non_str_key"] = outcome(lambda: tq.kv_batch_get(keys=[1], partition_id="train"))
        out["put_nothing"] = outcome(lambda: tq.kv_put(key="x", partition_id="train"))
        out["batch_put_nothing"] = outcome(
            lambda: tq.kv_batch_put(keys=["x"], partition_id="train")
        )
        out["tags_count_mismatch"] = outcome(
            lambda: tq.kv_batch_put(keys=["x", "y"], partition_id="train", tags=[{}])
        )
        out["fields_count_mismatch"] = outcome(
            lambda: tq.kv_batch_put(
                keys=["x", "y", "z"], partition_id="train", fields=_column("a", [1, 2])
            )
        )
        out["by_meta_field_not_in_meta"] = outcome(
            lambda: tq.kv_batch_get_by_meta(
                tq.KVBatchMeta(keys=["full"], tags=[{}], partition_id="train", fields=["a"]),
                select_fields=["b"],
            )
        )
        out["by_meta_without_partition"] = outcome(
            lambda: tq.kv_batch_get_by_meta(tq.KVBatchMeta(keys=["full"], tags=[{}]))
        )
        out["put_without_partition"] = outcome(lambda: client.put(data=_column("a", [1])))
        out["get_data_empty_meta"] = outcome(
            lambda: client.get_data(tq.BatchMeta.empty()), rec.tensordict
        )
        out["list_after_mistakes"] = tq.kv_list()
    return out


def fetch_shortfall(tq: Any) -> dict:
    """get_meta for more than is ready: a field missing from some samples, a wrong partition, a
    batch larger than what exists. TransferQueue waits for its timeout, then raises."""
    out: dict[str, Any] = {}
    with running(tq) as client:
        meta = client.put(data=_column("a", [1, 2, 3]), partition_id="train")
        client.put(data=_column("b", [4]), metadata=meta.select_samples([0]))

        def get(fields: list[str], batch_size: int, partition_id: str) -> Callable[[], Any]:
            return lambda: client.get_meta(
                data_fields=fields, batch_size=batch_size, partition_id=partition_id, task_name="t"
            )

        out["field_missing_from_some_samples"] = outcome(get(["a", "b"], 2, "train"))
        out["wrong_partition"] = outcome(get(["a"], 1, "val"))
        out["batch_larger_than_exists"] = outcome(get(["a"], 4, "train"))
        out["nothing_consumed_by_failures"] = outcome(get(["a"], 3, "train"), rec.batch_meta)
    return out


def polling_mode(tq: Any) -> dict:
    """With `controller.polling_mode`, a short get_meta returns an empty BatchMeta at once."""
    out: dict[str, Any] = {}
    with running(tq, _conf(polling_mode=True)) as client:
        empty = client.get_meta(
            data_fields=["a"], batch_size=2, partition_id="train", task_name="t"
        )
        out["empty_partition"] = rec.batch_meta(empty)
        client.put(data=_column("a", [1]), partition_id="train")
        out["short"] = rec.batch_meta(
            client.get_meta(data_fields=["a"], batch_size=2, partition_id="train", task_name="t")
        )
        client.put(data=_column("a", [2]), partition_id="train")
        full = client.get_meta(data_fields=["a"], batch_size=2, partition_id="train", task_name="t")
        out["full"] = rec.batch_meta(full)
        out["full_data"] = rec.tensordict(client.get_data(full))
    return out


def closed(tq: Any) -> dict:
    """What a closed TransferQueue answers: module functions and a client kept from before."""
    out: dict[str, Any] = {}
    with running(tq) as client:
        tq.kv_put(key="k", partition_id="train", fields={"a": torch.tensor([1])})
    out["kv_list"] = outcome(lambda: tq.kv_list())
    out["kv_put"] = outcome(lambda: tq.kv_put(key="k", partition_id="train", tag={"a": 1}))
    out["get_client"] = outcome(lambda: tq.get_client())
    out["load_checkpoint"] = outcome(lambda: tq.load_checkpoint("/nonexistent"))
    out["old_client_put"] = outcome(
        lambda: client.put(data=_column("a", [1]), partition_id="train")
    )
    with running(tq):
        out["reinit_is_empty"] = tq.kv_list()
    return out


def streaming_dataloader(tq: Any) -> dict:
    """StreamingDataset + StreamingDataLoader over a finite partition, as a data-parallel rank."""
    out: dict[str, Any] = {}
    conf = tq.init(_conf(sampler=tq.RankAwareSampler(), polling_mode=True))
    try:
        tq.get_client().put(data=_prompts(6), partition_id="train")
        dataset = tq.StreamingDataset(
            config=conf,
            batch_size=2,
            micro_batch_size=1,
            data_fields=["prompt", "text"],
            partition_id="train",
            task_name="actor",
            dp_rank=0,
            should_check_consumption_status=True,
        )
        out["micro_batches"] = [
            {"data": rec.tensordict(data), "meta": rec.batch_meta(meta)}
            for data, meta in tq.StreamingDataLoader(dataset)
        ]
        out["bad_micro_batch_size"] = outcome(
            lambda: tq.StreamingDataset(
                config=conf,
                batch_size=2,
                micro_batch_size=0,
                data_fields=["prompt"],
                partition_id="train",
                task_name="actor",
                dp_rank=0,
            ),
            lambda dataset: "created",
        )
    finally:
        tq.close()
    return out


def seqlen_balanced(tq: Any) -> dict:
    """SeqlenBalancedSampler: whole GRPO groups, spread over DP ranks by `total_lengths`."""
    out: dict[str, Any] = {}
    sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
    with running(tq, _conf(sampler=sampler)) as client:
        meta = client.put(data=_prompts(8), partition_id="train")
        lengths = [10, 1, 9, 2, 8, 3, 7, 4]
        meta.update_custom_meta([{"total_lengths": n} for n in lengths])
        client.set_custom_meta(meta)
        for dp_rank in (0, 1):
            fetched = client.get_meta(
                data_fields=["prompt"],
                batch_size=4,
                partition_id="train",
                task_name="actor",
                sampling_config={
                    "dp_rank": dp_rank,
                    "batch_index": 0,
                    "task_name": "actor",
                    "partition_id": "train",
                },
            )
            out[f"rank{dp_rank}"] = rec.batch_meta(fetched)
    return out


SCENARIOS: dict[str, Callable[[Any], dict]] = {
    fn.__name__: fn
    for fn in (
        kv_roundtrip,
        kv_jagged,
        kv_prompt_groups,
        native_by_task,
        native_put_with_meta,
        grpo_groups,
        rank_aware_dp,
        seqlen_balanced,
        custom_meta,
        partitions,
        checkpoints,
        async_twins,
        pickled_meta,
        meta_methods,
        bad_inputs,
        fetch_shortfall,
        polling_mode,
        streaming_dataloader,
        closed,
    )
}
