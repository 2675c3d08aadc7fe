"""The queue on a real local Ray cluster (two nodes): placement, discovery by name, put/get/ack
from actors, deaths named with Ray's reason, fast placement failures, clean shutdown."""

import concurrent.futures
import os
import re
import select
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

ray = pytest.importorskip("ray", reason="the Ray tests need the [ray] extra")

from rlferry.queue import ServiceGone  # noqa: E402
from rlferry.ray import LaunchError, RayQueue, queue  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster, processes killed on purpose, or a long run

KILLED = "The actor is dead because it was killed by `ray.kill`."


def kill(actor):
    """``ray.kill``, returning once the actor's process is gone and Ray reports it dead (the
    kill is asynchronous: under load the process outlived Ray's report)."""
    pid = ray.get(actor.where.remote(), timeout=30)["pid"]
    exited = os.pidfd_open(pid)
    try:
        ray.kill(actor)
        assert select.select([exited], [], [], 30)[0], f"actor process {pid} still runs"
    finally:
        os.close(exited)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.until_closed.remote(), timeout=30)


def _nodes_of(pg):
    return set(ray.util.placement_group_table(pg)["bundles_to_node_id"].values())


def test_storage_units_spread_one_per_node(ray_cluster):
    with RayQueue.start("spread", cpus_per_unit=0.5) as q:
        # unit 0 in the controller's actor, unit 1 an actor of its own
        assert q.names == ["rlferry/spread/controller", "rlferry/spread/storage1"]
        assert len(_nodes_of(q.placement_group)) == 2  # two units, one on each node
        assert len(q.client().statistics().storage_units) == 2


@ray.remote(num_cpus=0)
class _Producer:
    def put(self, job, n):
        client = queue(job)  # by name: no address, no secret
        data = {"x": torch.arange(n, dtype=torch.float32)}
        return client.put("p0", data, meta={"k": list(range(n))})


@ray.remote(num_cpus=0)
def _consume(job, n):
    client = queue(job)
    batch = client.get("p0", task="train", batch_size=n, fields=["x"], timeout=30)
    acked = client.ack(batch)
    return batch.data["x"].tolist(), batch.meta["k"], acked


def test_discovery_and_put_get_ack_from_actors_and_tasks(ray_cluster):
    with RayQueue.start("discover", storage_units=2, cpus_per_unit=0.5):
        consumed = _consume.remote("discover", 6)  # waits at the controller for the put
        indexes = ray.get(_Producer.remote().put.remote("discover", 6), timeout=60)
        values, keys, acked = ray.get(consumed, timeout=60)
    assert indexes == list(range(6))
    assert values == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert keys == list(range(6))
    assert acked == 6


def test_queue_of_an_unknown_job_names_it(ray_cluster):
    ns = ray.get_runtime_context().namespace
    with pytest.raises(LaunchError) as e:
        queue("nobody")
    assert str(e.value) == (
        f"job `nobody`: no actor `rlferry/nobody/controller` in Ray namespace `{ns}` (start it "
        "with rlferry.ray.RayQueue.start, or pass the job's namespace=)"
    )


def test_controller_killed_fails_a_parked_get_naming_the_actor(ray_cluster):
    with RayQueue.start("ctrl-kill", storage_units=1, cpus_per_unit=0.5) as q:
        client = q.client()
        client.put("p0", {"x": torch.zeros(2)})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            parked = pool.submit(
                client.get, "p1", task="train", batch_size=4, fields=["x"], timeout=60
            )
            client.statistics()  # the get is parked once the controller counts it
            ray.kill(q.actors["rlferry/ctrl-kill/controller"])
            with pytest.raises(ServiceGone) as e:
                parked.result(timeout=10)
    assert re.fullmatch(
        r"actor `rlferry/ctrl-kill/controller` \(tcp://[0-9.]+:\d+\) died: " + re.escape(KILLED),
        str(e.value),
    )


def test_storage_unit_killed_names_it_and_puts_go_to_the_other(ray_cluster):
    tasks = ("train", "critic")
    with RayQueue.start("unit-kill", storage_units=2, cpus_per_unit=0.5, tasks=tasks) as q:
        client = q.client()
        client.put("a", {"x": torch.arange(4.0)})  # a put goes whole to the emptiest unit: 0
        client.put("b", {"x": torch.arange(4.0)})  # then 1
        client.get("b", task="train", batch_size=4, fields=["x"], timeout=30)
        units = client.statistics().storage_units
        assert [u.samples for u in units] == [4, 4]
        holder, name = 1, "rlferry/unit-kill/storage1"  # unit 0 is the controller's actor
        kill(q.actors[name])
        with pytest.raises(ServiceGone) as e:  # its rows went with it
            client.get("b", task="critic", batch_size=4, fields=["x"], timeout=30)
        alive = [u.alive for u in client.statistics().storage_units]
        client.put("c", {"x": torch.arange(4.0)})  # the controller avoids the dead unit
        got = client.get("c", task="train", batch_size=4, fields=["x"], timeout=30)
        sockets = [s["ipc"].removeprefix("ipc://") for s in q.services.values()]
    assert alive == [u != holder for u in range(2)]
    assert got.data["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not any(os.path.exists(path) for path in sockets)  # the dead unit's too
    assert re.fullmatch(
        rf"actor `{name}` \(tcp://[0-9.]+:\d+\) died: " + re.escape(KILLED), str(e.value)
    )


def test_an_infeasible_group_fails_within_ready_timeout_naming_bundles_and_nodes(ray_cluster):
    with pytest.raises(LaunchError) as e:
        RayQueue.start("too-big", bundles=[{"CPU": 64}, {"CPU": 1, "GPU": 8}], ready_timeout=1)
    text = str(e.value)
    head = (
        "job `too-big`: storage units: Ray could not place 2 bundles [{CPU: 64}, "
        "{CPU: 1, GPU: 8}] (SPREAD) within 1 s; free per node: "
    )
    assert text.startswith(head), text
    assert text.endswith(" (ask for fewer or smaller bundles, or add nodes)")
    nodes = text[len(head) :].split("; ")
    assert len(nodes) == 2  # each node named with what it has free
    assert all(re.match(r"[0-9.]+/[0-9a-f]{8}: CPU [0-9.]+, GPU [0-9.]+, memory", n) for n in nodes)
    assert not any(  # the group asked is gone with the error
        g["name"] == "rlferry/too-big/storage" and g["state"] != "REMOVED"
        for g in ray.util.placement_group_table().values()
    )


def test_a_job_name_taken_twice_fails_with_a_message(ray_cluster):
    ns = ray.get_runtime_context().namespace
    with (
        RayQueue.start("twice", storage_units=1, cpus_per_unit=0.5),
        pytest.raises(LaunchError) as e,
    ):
        RayQueue.start("twice", storage_units=1, cpus_per_unit=0.5)
    assert str(e.value) == (
        f"job `twice`: its queue is already running in Ray namespace `{ns}` (actor "
        "`rlferry/twice/controller`): close it, or start this one under another job name"
    )


def _refused(address):
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def test_close_removes_actors_group_sockets_and_shared_memory(ray_cluster):
    shm_before = set(os.listdir("/dev/shm"))
    q = RayQueue.start("clean", storage_units=2, cpus_per_unit=0.5)
    client = q.client()
    client.put("p0", {"x": torch.zeros(1 << 16)})  # through shared memory (ipc://, one node)
    client.get("p0", task="train", batch_size=1 << 16, fields=["x"], timeout=30)
    services = dict(q.services)
    assert all(os.path.exists(s["ipc"].removeprefix("ipc://")) for s in services.values())
    q.close()
    named = ray.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if a["name"].startswith("rlferry/clean/")]
    assert ray.util.placement_group_table(q.placement_group)["state"] == "REMOVED"
    assert all(_refused(address) for address in services)
    assert not any(os.path.exists(s["ipc"].removeprefix("ipc://")) for s in services.values())
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_a_dead_driver_takes_its_actors_with_it(ray_cluster):
    driver = textwrap.dedent(f"""
        import sys, ray
        ray.init(address={ray_cluster.address!r}, namespace="orphans")
        from rlferry.ray import RayQueue
        q = RayQueue.start("orphan", storage_units=1, cpus_per_unit=0.5)
        print("ready", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline() == "ready\n"
        ctrl = ray.get_actor("rlferry/orphan/controller", namespace="orphans")
        end = ctrl.until_closed.remote()
    finally:
        proc.kill()
        proc.wait(30)
    with pytest.raises(ray.exceptions.ActorDiedError) as e:
        ray.get(end, timeout=30)
    # Ray's reason: the driver that owned it died, or (when the worker's end is seen first)
    # the worker died with it; both were seen on the same 2-core machine
    assert "owner" in str(e.value) or "died unexpectedly" in str(e.value), str(e.value)
    # (its placement group goes when Ray ends the dead driver's job: not awaited here, Ray
    # gives no event for it)


def test_a_removed_node_fails_calls_naming_the_actor(ray_cluster):
    node = ray_cluster.add_node(num_cpus=1, resources={"doomed": 1})
    ray_cluster.wait_for_nodes()
    bundles = [{"CPU": 0.5}, {"CPU": 0.5, "doomed": 1}]  # unit 1 on the new node
    with RayQueue.start("node-loss", bundles=bundles, tasks=("train", "critic")) as q:
        client = q.client()
        client.put("a", {"x": torch.arange(4.0)})  # unit 0
        client.put("b", {"x": torch.arange(4.0)})  # unit 1
        client.get("b", task="train", batch_size=4, fields=["x"], timeout=30)
        ray_cluster.remove_node(node)
        with pytest.raises(ServiceGone) as e:
            client.get("b", task="critic", batch_size=4, fields=["x"], timeout=30)
    assert re.fullmatch(  # Ray's reason, e.g. "the actor's node was terminated expectedly: ..."
        r"actor `rlferry/node-loss/storage1` \(tcp://[0-9.]+:\d+\) died: .*node.*", str(e.value)
    )
