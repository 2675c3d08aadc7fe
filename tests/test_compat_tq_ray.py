"""TransferQueue's API across the processes of a Ray job: ``tq.init()`` in the driver starts
the queue's service as a named actor, and tasks and actors of the job reach it by name,
on the shared two-node local cluster (tests/conftest.py)."""

import os
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("ray", reason="the Ray tests need the [ray] extra")
pytest.importorskip("tensordict", reason="the shim needs the [tq] extra")

import ray
from tensordict import TensorDict

import rlferry.compat.transferqueue as tq
from rlferry.compat.transferqueue import _interface
from rlferry.compat.transferqueue._backend import embedded
from rlferry.compat.transferqueue._ray import JOB
from rlferry.ray import LaunchError
from rlferry.ray._common import actor_name

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import it
SERVICE = actor_name(JOB, "service")
DEATH_BOUND = 5.0  # s: a bound on the wait for the error, not a measure of its speed


def produce() -> list[int]:
    """A producer's put: tensors, a jagged field and strings, with custom meta."""
    tq.init()
    client = tq.get_client()
    data = TensorDict(
        {
            "x": torch.arange(6),
            "ids": torch.nested.as_nested_tensor(
                [torch.arange(i + 1) for i in range(6)], layout=torch.jagged
            ),
            "prompt": [f"q{i}" for i in range(6)],
        },
        batch_size=6,
    )
    meta = client.get_meta(["x", "ids", "prompt"], 6, "train_0", mode="insert")
    meta.update_custom_meta([{"group": i // 3} for i in range(6)])
    return client.put(data, metadata=meta).global_indexes  # the custom meta goes with it


def consume() -> dict:
    """A trainer's read: get_meta (waits for the put), get_data, then the status."""
    client = tq.get_client()
    meta = client.get_meta(["x", "ids", "prompt"], 6, "train_0", task_name="actor_train")
    data = client.get_data(meta)
    return {
        "indexes": meta.global_indexes,
        "custom": meta.custom_meta,
        "x": data["x"].tolist(),
        "ids": [r.tolist() for r in data["ids"].unbind()],
        "prompt": list(data["prompt"]),
        "consumed": client.check_consumption_status("actor_train", "train_0"),
    }


def use_kv() -> dict:
    """The KV API: put, list, get, clear."""
    tq.kv_batch_put(
        keys=["a", "b"],
        partition_id="kv",
        fields=TensorDict({"v": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, batch_size=2),
        tags=[{"step": 0}, {"step": 1}],
    )
    got = tq.kv_batch_get(keys=["b", "a"], partition_id="kv")
    listed = tq.kv_list("kv")
    tq.kv_clear(keys="a", partition_id="kv")
    return {
        "v": [r.tolist() for r in got["v"].unbind()],
        "listed": listed,
        "after_clear": tq.kv_list("kv"),
    }


@ray.remote
def produce_task() -> list[int]:
    return produce()


@ray.remote
class Reader:
    def consume(self) -> dict:
        return consume()

    def use_kv(self) -> dict:
        return use_kv()

    def pid(self) -> int:
        return os.getpid()

    def connect(self) -> list[str]:
        return tq.get_client().get_partition_list()

    def wait_for_nothing(self) -> str:
        """A get_meta that waits for a partition nobody fills; its error, named."""
        try:
            tq.get_client().get_meta(["x"], 1, "empty", task_name="reader")
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"


@pytest.fixture
def on_ray(ray_cluster):
    tq.init({"controller": {"get_meta_timeout": 30}})
    yield
    tq.close()


def test_init_in_the_driver_starts_the_service_as_a_named_actor_of_the_job(on_ray):
    actor = ray.get_actor(SERVICE)
    assert ray.get(actor.where.remote())["pid"] != os.getpid()


def test_tasks_and_actors_of_the_job_share_the_queue_with_the_same_results_as_embedded(on_ray):
    reader = Reader.remote()
    waiting = reader.consume.remote()  # parked at the service until the put lands
    indexes = ray.get(produce_task.remote(), timeout=120)
    consumed = ray.get(waiting, timeout=120)
    kv = ray.get(Reader.remote().use_kv.remote(), timeout=120)
    assert ray.get(reader.pid.remote()) != os.getpid()

    tq.close()  # the same scenario, in one process, on the embedded backend
    tq.use_launcher(lambda conf: embedded(conf, tq.SequentialSampler()))
    try:
        tq.init()
        expected = (produce(), consume(), use_kv())
    finally:
        tq.close()
        tq.use_launcher(None)
    tq.init()  # for the fixture's close
    assert (indexes, consumed, kv) == expected
    assert consumed["x"] == [0, 1, 2, 3, 4, 5]
    assert consumed["ids"][2] == [0, 1, 2]
    assert consumed["custom"] == [{"group": i // 3} for i in range(6)]
    assert kv["listed"] == {"kv": {"a": {"step": 0}, "b": {"step": 1}}}


def test_a_dead_service_actor_fails_a_waiting_get_meta_naming_the_actor_and_why(on_ray):
    client = tq.get_client()
    assert client.get_partition_list() == []  # connected
    outcome: dict = {}

    def wait() -> None:
        try:
            client.get_meta(["x"], 1, "empty", task_name="t")
        except Exception as e:
            outcome["error"], outcome["at"] = e, time.monotonic()

    reader = Reader.remote()
    assert ray.get(reader.connect.remote()) == []
    in_actor = reader.wait_for_nothing.remote()
    waiter = threading.Thread(target=wait)
    waiter.start()
    ray.get(ray.get_actor(SERVICE).connection.remote())  # the get_metas are on their way
    time.sleep(0.5)  # let them park at the service before the kill
    killed = time.monotonic()
    ray.kill(ray.get_actor(SERVICE))
    waiter.join(DEATH_BOUND)
    assert not waiter.is_alive(), f"get_meta still waiting {DEATH_BOUND} s after the kill"
    error = outcome["error"]
    assert isinstance(error, tq.ServiceGone) and isinstance(error, RuntimeError)
    assert f"actor `{SERVICE}`" in str(error)
    assert "killed by `ray.kill`" in str(error)
    print(f"get_meta failed {outcome['at'] - killed:.3f} s after the kill: {error}")
    told = ray.get(in_actor, timeout=DEATH_BOUND)  # the actor's get_meta failed as well
    assert told.startswith(f"ServiceGone: fetch: actor `{SERVICE}`")
    assert "killed by `ray.kill`" in told


def test_close_removes_the_actor_its_socket_and_its_shared_memory(on_ray):
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    address = _interface.current_backend().controller.link.address
    tq.get_client().put(
        TensorDict({"x": torch.zeros(64, 1 << 14)}, batch_size=64), partition_id="p"
    )
    assert address.startswith("ipc://") and os.path.exists(address.removeprefix("ipc://"))
    tq.close()
    with pytest.raises(ValueError):
        ray.get_actor(SERVICE)
    assert not os.path.exists(address.removeprefix("ipc://"))
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert shm_after <= shm_before
    with pytest.raises(tq.NotInitialized):
        tq.get_client()
    tq.init()  # for the fixture's close


def test_a_second_init_in_a_worker_reuses_the_drivers_service(on_ray):
    @ray.remote
    def init_twice() -> list[str]:
        tq.init({"controller": {"polling_mode": True}})  # conf not used: attaching
        tq.init()
        return tq.get_client().get_partition_list()

    tq.get_client().put(TensorDict({"x": torch.ones(2)}, batch_size=2), partition_id="seen")
    assert ray.get(init_twice.remote(), timeout=120) == ["seen"]


def test_a_node_resource_no_node_has_fails_at_once_naming_it(ray_cluster):
    with pytest.raises(LaunchError) as e:
        tq.init({"backend": {"SimpleStorage": {"required_node_resource": "tq_storage"}}})
    assert str(e.value).startswith(
        "config `backend.SimpleStorage.required_node_resource`: expected a resource some node "
        "of the cluster has, got 'tq_storage', which none has (the cluster has ['CPU', "
    )
    with pytest.raises(ValueError):
        ray.get_actor(SERVICE)


def test_a_process_of_another_node_reaches_the_service_over_tcp_with_the_jobs_secret(on_ray):
    """Both nodes of the test cluster share one host (they reach the actor over ipc://): the
    way another host reaches it, the node's address and the secret, is taken here by hand."""
    from rlferry.compat.transferqueue._backend import Connection, remote
    from rlferry.wire import SecurityError

    connection = _interface.current_backend().connection
    assert connection.address.startswith("tcp://") and connection.secret
    far = remote(connection)
    try:
        client = tq.TransferQueueClient("far")
        client._backend = far
        client.put(TensorDict({"x": torch.arange(4.0)}, batch_size=4), partition_id="far")
        meta = client.get_meta(["x"], 4, "far", task_name="t")
        assert client.get_data(meta)["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
        stranger = remote(Connection(connection.address, "0" * 64, connection.timeout))
        with pytest.raises(SecurityError):
            stranger.controller.partitions()
        stranger.close()
    finally:
        far.close()
