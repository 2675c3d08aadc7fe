"""rlferry.compat.transferqueue: TransferQueue's API on rlferry (its own upstream tests run
through tests/tq_upstream/run.sh; these cover what they do not: waits, errors, the install)."""

import asyncio
import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

tensordict = pytest.importorskip("tensordict", reason="the [tq] extra (tensordict) is missing")
pytest.importorskip("omegaconf", reason="the [tq] extra (omegaconf) is missing")

import rlferry.compat.transferqueue as tq  # noqa: E402
from rlferry.compat.transferqueue import (  # noqa: E402
    BatchMeta,
    ClientClosed,
    GetMetaTimeout,
    NotInitialized,
    StorageKeyNotFoundError,
)
from rlferry.compat.transferqueue.metadata import samples_of  # noqa: E402
from rlferry.wire import FileFormatError  # noqa: E402

TensorDict = tensordict.TensorDict


def started(**controller):
    tq.init({"controller": controller})
    return tq.get_client()


@pytest.fixture
def client():
    """Waits for data 0.3 s: long enough for what is there, short for what never comes."""
    yield started(get_meta_timeout=0.3)
    tq.close()


@pytest.fixture
def patient():
    """Waits for data 60 s: the tests that use it never wait that long (a put wakes them)."""
    yield started(get_meta_timeout=60)
    tq.close()


@pytest.fixture
def polling():
    yield started(polling_mode=True)
    tq.close()


def rows(n, start=0):
    return TensorDict({"x": torch.arange(start, start + n).float()}, batch_size=n)


def test_install_resolves_transfer_queue_and_the_submodules_tests_import():
    tq.install()
    import transfer_queue
    from transfer_queue.metadata import BatchMeta as Meta
    from transfer_queue.sampler.seqlen_balanced_sampler import get_seqlen_balanced_partitions
    from transfer_queue.storage import StorageKeyNotFoundError as Missing

    assert transfer_queue.init is tq.init
    assert Meta is BatchMeta
    assert Missing is StorageKeyNotFoundError
    assert get_seqlen_balanced_partitions([1, 2, 3, 4], 2, equal_size=True) == [[0, 3], [1, 2]]


# TransferQueue 0.1.11's `transfer_queue.__all__`, copied from its __init__.py.
TQ_ALL = [
    "init",
    "close",
    "get_metrics_endpoint",
    "kv_put",
    "kv_batch_put",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_list",
    "kv_clear",
    "async_kv_put",
    "async_kv_batch_put",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_list",
    "async_kv_clear",
    "KVBatchMeta",
    "save_checkpoint",
    "load_checkpoint",
    "StreamingDataset",
    "StreamingDataLoader",
    "get_client",
    "BatchMeta",
    "TransferQueueClient",
    "StorageKeyNotFoundError",
    "BaseSampler",
    "GRPOGroupNSampler",
    "SequentialSampler",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
]


def test_the_installed_module_carries_what_transferqueues_does():
    import importlib.util
    import os

    import rlferry

    tq.install()
    import transfer_queue

    assert transfer_queue.__all__ == TQ_ALL
    star: dict = {}
    exec("from transfer_queue import *", star)
    assert sorted(n for n in star if n != "__builtins__") == sorted(TQ_ALL)
    assert transfer_queue.__version__ == "0.1.11"
    assert transfer_queue.__rlferry_version__ == rlferry.__version__
    assert os.path.isfile(transfer_queue.__file__)
    assert importlib.util.find_spec("transfer_queue").origin == transfer_queue.__file__
    for name, exported in [
        ("transfer_queue.sampler", ["BaseSampler", "SequentialSampler", "GRPOGroupNSampler",
                                    "RankAwareSampler", "SeqlenBalancedSampler"]),
        ("transfer_queue.dataloader", ["StreamingDataset", "StreamingDataLoader"]),
        ("transfer_queue.storage", ["StorageKeyNotFoundError"]),
    ]:  # fmt: skip
        mod = sys.modules[name]
        assert mod.__all__ == exported
        assert all(hasattr(mod, n) for n in exported)
    for name in [n for n in sys.modules if n.startswith("transfer_queue.")]:
        mod = sys.modules[name]
        assert os.path.isfile(mod.__file__), name
        assert mod.__spec__.name == name


def test_get_meta_on_an_empty_partition_returns_when_a_put_lands(patient):
    got = {}
    asking = threading.Thread(
        target=lambda: got.update(meta=patient.get_meta(["x"], 2, "p", task_name="t"))
    )
    asking.start()
    patient.put(rows(2), partition_id="p")
    asking.join(timeout=30)
    assert got["meta"].global_indexes == [0, 1]
    assert patient.get_data(got["meta"])["x"].reshape(-1).tolist() == [0.0, 1.0]


def test_async_get_meta_is_woken_by_a_put_from_another_thread(patient):
    async def scenario():
        asking = asyncio.ensure_future(patient.async_get_meta(["x"], 3, "p", task_name="t"))
        await asyncio.sleep(0)  # one turn of the loop: the get_meta parks
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: patient.put(rows(3), partition_id="p")
        )
        return await asyncio.wait_for(asking, timeout=30)

    assert asyncio.run(scenario()).size == 3


def test_get_meta_times_out_with_transferqueues_exception_type_and_says_why(client):
    client.put(rows(1), partition_id="p")
    with pytest.raises(RuntimeError) as e:
        client.get_meta(["x", "y"], 4, "p", task_name="t")
    assert type(e.value) is GetMetaTimeout
    assert str(e.value) == (
        "get_meta `p` for task `t`: expected 4 ready samples with fields ['x', 'y'], got 0 "
        "after waiting 0.3 s (Timeout while waiting for sufficient data; the partition holds "
        "fields ['x']; no put brought fields ['y']: a misspelled field?)"
    )


def test_get_meta_of_a_wrong_partition_names_the_partitions(client):
    client.put(rows(1), partition_id="train_0")
    with pytest.raises(GetMetaTimeout) as e:
        client.get_meta(["x"], 1, "train_1", task_name="t")
    assert str(e.value) == (
        "get_meta: expected partition `train_1`, got no such partition after waiting 0.3 s "
        "(partitions: ['train_0']; a misspelled partition_id, or no put yet)"
    )


def test_a_sampler_that_raises_is_reported_as_a_runtime_error():
    tq.init({"controller": {"sampler": tq.GRPOGroupNSampler(n_samples_per_prompt=4)}})
    try:
        client = tq.get_client()
        client.put(rows(6), partition_id="p")
        with pytest.raises(RuntimeError) as e:
            client.get_meta(["x"], 6, "p", task_name="t")
        assert str(e.value) == (
            "get_meta `p` for task `t`: the sampler GRPOGroupNSampler raised ValueError: "
            "batch_size (6) must be a multiple of n_samples_per_prompt (4)"
        )
    finally:
        tq.close()


def test_polling_mode_returns_an_empty_batch_at_once(polling):
    assert polling.get_meta(["x"], 1, "p", task_name="t").size == 0


def test_clear_partition_removes_it_from_the_lists_even_after_its_keys_were_cleared(client):
    tq.kv_batch_put(["a", "b"], "p", rows(2))
    tq.kv_clear(["a", "b"], "p")
    assert tq.kv_list() == {"p": {}}
    client.clear_partition("p")
    assert client.get_partition_list() == []
    assert tq.kv_list() == {}


def test_a_put_whose_rows_do_not_match_its_metadata_stores_nothing(client):
    meta = client.get_meta(["x"], 3, "p", mode="insert")
    with pytest.raises(ValueError) as e:
        client.put(rows(2), metadata=meta)
    assert str(e.value) == (
        "data: expected 3 rows (the BatchMeta's size), got 2 (put one row per sample of the "
        "metadata)"
    )
    assert client.check_production_status(["x"], "p") is False


def test_a_put_for_samples_of_a_cleared_partition_is_refused(client):
    meta = client.get_meta(["x"], 2, "p", mode="insert")
    client.clear_partition("p")
    with pytest.raises(ValueError) as e:
        client.put(rows(2), metadata=meta)
    assert str(e.value) == (
        "metadata: expected samples of existing partitions, got samples of ['p'], which do "
        "not exist (cleared since the BatchMeta was made? partitions: [])"
    )


def test_kv_batch_get_of_a_field_some_keys_lack_names_it(client):
    tq.kv_put("a", "p", {"x": torch.tensor(1.0), "y": torch.tensor(2.0)})
    tq.kv_put("b", "p", {"x": torch.tensor(3.0)})
    with pytest.raises(ValueError) as e:
        tq.kv_batch_get(["a", "b"], "p", select_fields=["y"])
    assert str(e.value) == (
        "Some fields are not ready in all the requested keys! expected fields ['y'] in each of "
        "2 keys of `p`, got keys without them (fields all these keys hold: ['x'])"
    )
    assert tq.kv_batch_get(["a", "b"], "p")["x"].reshape(-1).tolist() == [1.0, 3.0]


def test_kv_batch_get_of_a_wrong_partition_names_the_partitions(client):
    tq.kv_put("a", "p", {"x": torch.tensor(1.0)})
    with pytest.raises(ValueError) as e:
        tq.kv_batch_get("a", "q")
    assert str(e.value) == (
        "keys or partition were not found! expected keys 'a' in partition `q` (partitions: ['p'])"
    )


def test_get_data_of_cleared_samples_raises_storage_key_not_found(client):
    meta = client.put(rows(2), partition_id="p")
    client.clear_samples(meta[1:])
    with pytest.raises(KeyError) as e:
        client.get_data(meta)
    assert type(e.value) is StorageKeyNotFoundError
    assert str(e.value) == (
        "field `x`: expected a value for every requested sample, got none for global indexes "
        "[1] (cleared, or never put: check the BatchMeta's production status before get_data)"
    )


def test_a_client_made_with_transferqueues_positional_arguments_reaches_the_queue(client):
    mine = tq.TransferQueueClient("mine", None, 2, 64)  # client_id, controller_info, zmq settings
    mine.put(rows(3), partition_id="p")
    assert client.get_partition_list() == ["p"]


def test_a_closed_client_and_a_closed_system_say_so(client):
    tq.close()
    with pytest.raises(RuntimeError) as e:
        client.get_partition_list()
    assert type(e.value) is ClientClosed
    assert str(e.value) == (
        "client `TransferQueueClient_"
        f"{client.client_id.rsplit('_', 1)[1]}`: expected an open client, got one that was "
        "closed (call tq.init() again and use tq.get_client())"
    )
    with pytest.raises(AssertionError) as e2:
        tq.kv_list()
    assert type(e2.value) is NotInitialized
    assert str(e2.value) == (
        "TransferQueue is not initialized: expected tq.init() first, got a call before it or "
        "after tq.close() (Please call init() first)"
    )


def test_unknown_and_unsupported_configuration_is_refused_by_its_dotted_key():
    with pytest.raises(ValueError) as e:
        tq.init({"controller": {"poling_mode": True}})
    assert str(e.value) == (
        "config `controller.poling_mode`: expected one of TransferQueue's keys "
        "(get_meta_timeout, polling_mode, sampler, zmq_info), got an unknown key (a "
        "misspelling? rlferry's shim reads TransferQueue 0.1.11's keys)"
    )
    with pytest.raises(ValueError) as e:
        tq.init({"backend": {"storage_backend": "MooncakeStore"}})
    assert str(e.value) == (
        "config `backend.storage_backend`: expected 'SimpleStorage', got 'MooncakeStore' "
        "(rlferry keeps the data in its own store; Mooncake and Yuanrong are not supported)"
    )


def test_batch_meta_holds_arrays_and_survives_pickle(client):
    client.put(rows(1000), partition_id="p")
    meta = client.get_meta(["x"], 1000, "p", task_name="t")
    samples = samples_of(meta)
    assert isinstance(samples.indexes, np.ndarray)
    assert samples.custom is None and samples.partition == "p"  # no per-sample objects
    back = pickle.loads(pickle.dumps(meta))
    assert back.global_indexes == list(range(1000))
    assert back.partition_ids == ["p"] * 1000
    assert client.get_data(back)["x"].reshape(-1).tolist() == [float(i) for i in range(1000)]


def test_a_batch_meta_unpickled_from_read_only_buffers_has_writable_arrays(client):
    client.put(rows(4), partition_id="p")
    meta = client.get_meta(["x"], 4, "p", task_name="t")
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(meta, protocol=5, buffer_callback=buffers.append)
    back = pickle.loads(data, buffers=[b.raw().toreadonly() for b in buffers])  # as Ray's
    assert buffers, "the arrays did not travel out of band: the case is not exercised"
    assert samples_of(back).indexes.flags.writeable
    assert back.production_status.flags.writeable
    back.add_fields(TensorDict({"y": torch.ones(4)}, batch_size=4))
    assert back.global_indexes == meta.global_indexes and back.is_ready


def test_custom_meta_reaches_the_next_get_meta(client):
    meta = client.put(rows(2), partition_id="p")
    meta.update_custom_meta([{"score": 1}, {"score": 2}])
    client.set_custom_meta(meta)
    got = client.get_meta(["x"], 2, "p", task_name="t")
    assert got.custom_meta == [{"score": 1}, {"score": 2}]


def test_a_checkpoint_brings_back_data_and_consumption(client, tmp_path):
    client.put(rows(4), partition_id="p")
    client.get_meta(["x"], 2, "p", task_name="t")
    tq.save_checkpoint(tmp_path / "ckpt", metadata={"step": 3})
    client.clear_partition("p")
    tq.load_checkpoint(tmp_path / "ckpt")
    rest = client.get_meta(["x"], 2, "p", task_name="t")
    assert rest.global_indexes == [2, 3]
    assert client.get_data(rest)["x"].reshape(-1).tolist() == [2.0, 3.0]


def test_a_checkpoint_holds_no_pickle_and_keeps_custom_meta_and_the_samplers_cache(tmp_path):
    client = started(get_meta_timeout=0.3, sampler=tq.RankAwareSampler())
    rank0 = [
        {"dp_rank": 0, "batch_index": b, "task_name": "t", "partition_id": "p"} for b in range(2)
    ]
    try:
        meta = client.put(rows(4), partition_id="p")
        meta.update_custom_meta([{"score": i, "tags": {1: "a"}} for i in range(4)])
        client.set_custom_meta(meta)
        first = client.get_meta(["x"], 2, "p", task_name="t", sampling_config=rank0[0])
        tq.save_checkpoint(tmp_path / "ckpt")
        names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
        assert names == ["controller_state.rlf", "metadata.json", "storage.rlf"]
        for name in ("controller_state.rlf", "storage.rlf"):
            assert (tmp_path / "ckpt" / name).read_bytes()[:4] == b"\x89RLF"
        client.clear_partition("p")
        tq.load_checkpoint(tmp_path / "ckpt")
        again = client.get_meta(["x"], 2, "p", task_name="t", sampling_config=rank0[0])
        assert again.global_indexes == first.global_indexes == [0, 1]  # the cached answer
        rest = client.get_meta(["x"], 2, "p", task_name="t", sampling_config=rank0[1])
        assert rest.global_indexes == [2, 3]
        assert rest.custom_meta == [{"score": 2, "tags": {1: "a"}}, {"score": 3, "tags": {1: "a"}}]
    finally:
        tq.close()


def test_a_tampered_shim_checkpoint_is_refused_naming_the_file(client, tmp_path):
    client.put(rows(4), partition_id="p")
    tq.save_checkpoint(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "storage.rlf"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(FileFormatError) as e:
        tq.load_checkpoint(tmp_path / "ckpt")
    assert str(e.value).startswith(f"{path}: checksum mismatch")


def _transferqueues_own_checkpoint(client, path):
    """A checkpoint as TransferQueue writes one: torch.save pickles of the state's objects."""
    path.mkdir()
    torch.save(client._live.controller.state(), path / "controller_state.pt")
    torch.save(client._live.store.state(), path / "storage.pt")
    (path / "metadata.json").write_text('{"storage_saved": true, "user_metadata": {}}')


def test_transferqueues_pickled_checkpoint_is_refused_without_trust_pickle(client, tmp_path):
    client.put(rows(4), partition_id="p")
    _transferqueues_own_checkpoint(client, tmp_path / "ckpt")
    with pytest.raises(FileFormatError) as e:
        tq.load_checkpoint(tmp_path / "ckpt")
    assert str(e.value) == (
        f"{tmp_path / 'ckpt' / 'storage.pt'}: a torch.save archive (a zip file) "
        "(TransferQueue's own checkpoint format), which can run code when loaded: refused; "
        "load_checkpoint(..., trust_pickle=True) reads it if you trust the file"
    )


def test_transferqueues_pickled_checkpoint_is_read_with_trust_pickle(client, tmp_path):
    client.put(rows(4), partition_id="p")
    client.get_meta(["x"], 2, "p", task_name="t")
    _transferqueues_own_checkpoint(client, tmp_path / "ckpt")
    client.clear_partition("p")
    tq.load_checkpoint(tmp_path / "ckpt", trust_pickle=True)
    rest = client.get_meta(["x"], 2, "p", task_name="t")
    assert client.get_data(rest)["x"].reshape(-1).tolist() == [2.0, 3.0]


def test_streaming_dataset_ends_once_the_task_consumed_the_partition(polling):
    polling.put(rows(4), partition_id="p")
    ds = tq.StreamingDataset(
        config=None, batch_size=4, micro_batch_size=2, data_fields=["x"], partition_id="p",
        task_name="t", dp_rank=0, should_check_consumption_status=True,
    )  # fmt: skip
    got = [td["x"].reshape(-1).tolist() for td, _ in tq.StreamingDataLoader(ds)]
    assert got == [[0.0, 1.0], [2.0, 3.0]]


@pytest.mark.slow
@pytest.mark.parametrize("ray", ["absent", "installed, not started"])
def test_works_with_ray_absent_or_never_started(ray):
    if ray != "absent":
        pytest.importorskip("ray", reason="Ray is not installed (CI installs it for this case)")
    block = "sys.modules['ray'] = None; " if ray == "absent" else "import ray; "
    code = (
        f"import sys; {block}import torch; import rlferry.compat.transferqueue as t; "
        "t.install(); import transfer_queue as tq; from tensordict import TensorDict; tq.init(); "
        "tq.kv_batch_put(['k'], 'p', TensorDict({'x': torch.ones(1, 2)}, batch_size=1)); "
        "print(tq.kv_batch_get('k', 'p')['x'].sum().item())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"


def test_a_put_after_an_async_get_meta_timed_out_on_a_closed_loop_succeeds(client):
    with pytest.raises(GetMetaTimeout):
        asyncio.run(client.async_get_meta(["x"], 1, "p", task_name="t"))
    assert client.put(rows(1), partition_id="p").size == 1


def test_keys_put_cleared_put_again_mixed_and_through_a_checkpoint(client, tmp_path):
    tq.kv_batch_put([f"k{i}" for i in range(4)], "p", rows(4))
    tq.kv_clear(["k1", "k3", "nope"], "p")
    assert sorted(tq.kv_list("p")["p"]) == ["k0", "k2"]
    meta = tq.kv_batch_put(["k2", "k1", "k5"], "p", rows(3, start=10))  # one held, two new
    assert meta.keys == ["k2", "k1", "k5"] and meta.tags == [{}, {}, {}]
    assert meta.tags[0] is not meta.tags[1]
    got = tq.kv_batch_get(["k5", "k0", "k1", "k2"], "p")
    assert got["x"].reshape(-1).tolist() == [12.0, 0.0, 11.0, 10.0]
    held = client.kv_retrieve_meta(["k0", "k5"], "p").global_indexes
    assert client.kv_retrieve_keys(held, "p") == ["k0", "k5"]
    with pytest.raises(RuntimeError):
        client.kv_retrieve_keys([held[0], 10_000], "p")
    tq.save_checkpoint(tmp_path / "ckpt")
    client.clear_partition("p")
    tq.load_checkpoint(tmp_path / "ckpt")
    assert sorted(tq.kv_list("p")["p"]) == ["k0", "k1", "k2", "k5"]
    assert client.kv_retrieve_keys(held, "p") == ["k0", "k5"]
    tq.kv_clear(["k0", "k1", "k2", "k5"], "p")
    assert tq.kv_list("p") == {"p": {}}


def test_a_key_twice_in_one_kv_batch_put_is_refused_and_names_the_key(client):
    with pytest.raises(ValueError) as e:
        tq.kv_batch_put(["a", "b", "a"], "p", rows(3))
    assert "['a']" in str(e.value)


def test_a_queue_service_is_never_asked_to_unpickle_a_file():
    from rlferry.compat.transferqueue.backends._remote import RemoteController, RemoteStore
    from rlferry.errors import RequestError

    for remote in (RemoteController(None, 1.0), RemoteStore(None)):  # refused before any call
        with pytest.raises(RequestError, match="does not unpickle files on a request from"):
            remote.load_from("ckpt.pt", trust_pickle=True)
