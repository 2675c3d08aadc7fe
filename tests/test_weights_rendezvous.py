"""The broadcast group's rendezvous: reachable only by the group's peers.

Without a secret the store and gloo's sockets listen on loopback only; with a
secret the group meets over the authenticated control channel and no store
socket exists.
"""

import asyncio
import datetime
import os
import socket

import pytest
import torch.distributed as dist

from rlferry.weights import WeightReceiver, WeightSender, WeightSyncError
from rlferry.weights.protocol._messages import Join, StoreOp, encode
from rlferry.weights.transports._rendezvous import CallStore, KeyValue, loopback_store
from rlferry.wire import Client, RemoteError
from test_weights import Engine, state

SECRET = "a shared secret of 32 bytes long"


def listening_addresses():
    """The local addresses of every TCP socket of this process that listens."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                local, st, inode = cols[1], cols[3], cols[9]
                if st != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                raw, port = local.split(":")
                packed = bytes.fromhex(raw)
                if family == socket.AF_INET:
                    packed = packed[::-1]
                else:  # four little-endian 32-bit words
                    packed = b"".join(packed[i : i + 4][::-1] for i in range(0, 16, 4))
                out.append((socket.inet_ntop(family, packed), int(port, 16)))
    return out


def push_to(sender, sd, n=2, **kw):
    engines = [Engine(sd) for _ in range(n)]
    rs = [
        WeightReceiver(group="g", address=sender.address, load=e.load, name=f"r{i}", **kw).start()
        for i, e in enumerate(engines)
    ]
    report = sender.push(sd.items(), version=1, timeout=60)
    assert report.receivers == tuple(f"r{i}" for i in range(n))
    assert all(e.equals(sd) for e in engines)
    return rs, engines


def test_the_default_rendezvous_store_listens_on_loopback_only():
    s = WeightSender(group="g", transport="broadcast", receivers=2, bucket_bytes=256 << 10)
    rs, _ = push_to(s, state())
    host, port = s._pusher.parts.transport.store_address
    assert host == "127.0.0.1"
    assert [a for a, p in listening_addresses() if p == port] == ["127.0.0.1"]
    for r in rs:
        r.close()
    s.close()


def test_no_socket_of_a_loopback_gloo_group_listens_off_loopback():
    before = set(listening_addresses())  # (NCCL groups of earlier tests pick their own)
    s = WeightSender(group="g", transport="broadcast", receivers=2, bucket_bytes=256 << 10)
    rs, _ = push_to(s, state())  # gloo's own pair sockets included
    new = set(listening_addresses()) - before
    assert new and {a for a, _ in new} <= {"127.0.0.1", "::1"}
    for r in rs:
        r.close()
    s.close()


def test_with_a_secret_the_group_meets_over_the_control_channel():
    before = set(listening_addresses())
    s = WeightSender(group="g", transport="broadcast", receivers=2, bucket_bytes=256 << 10,
                     bind="tcp://127.0.0.1:*", secret=SECRET)  # fmt: skip
    sd = state()
    rs, engines = push_to(s, sd, secret=SECRET)
    assert s._pusher.parts.transport.store_address is None  # no store socket at all
    new = set(listening_addresses()) - before
    control_port = int(s.address.rpartition(":")[2])
    assert {a for a, _ in new} <= {"127.0.0.1"} and control_port in {p for _, p in new}
    for t in sd.values():
        if t.dtype.is_floating_point:
            t.add_(1)
    s.push(sd.items(), version=2, timeout=60)  # the group is reused
    assert s.statistics().groups_formed == 1 and all(e.equals(sd) for e in engines)
    for r in rs:
        r.close()
    s.close()


def test_a_receiver_without_the_secret_cannot_join_the_group():
    s = WeightSender(group="g", transport="broadcast", bind="tcp://127.0.0.1:*", secret=SECRET)
    r = WeightReceiver(group="g", address=s.address, load=lambda items: None, name="r0")
    with pytest.raises(WeightSyncError) as e:
        r.start(timeout=2)
    assert str(e.value).startswith(f"receiver `r0`: no answer from the sender at {s.address}")
    s.close()


def test_a_store_request_to_a_sender_without_a_secret_is_refused():
    s = WeightSender(group="g", transport="broadcast", receivers=1, bucket_bytes=256 << 10)
    try:
        with Client(s.address) as c:  # a receiver's requests, as its serving thread sends them
            c.request(encode(Join("g", "", "r0", socket.gethostname(), os.getpid())), timeout=10)
            with pytest.raises(RemoteError) as e:
                c.request(encode(StoreOp("get", "x", timeout=1)), timeout=10)
        assert e.value.kind == "WeightSyncError"
        assert "store request: this sender's group does not meet on its control channel" in str(
            e.value
        )
    finally:
        s.close()


# -- the store itself --------------------------------------------------------------------------


@pytest.fixture
def store():
    loop = asyncio.new_event_loop()
    kv = KeyValue()
    yield CallStore(lambda op: loop.run_until_complete(kv.serve(op)), timeout=0.2)
    loop.close()


def test_store_set_get_add_check_delete(store):
    store.set("a", b"1")
    store.set("s", "text")
    assert store.get("a") == b"1" and store.get("s") == b"text"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5 and store.get("n") == b"5"
    assert store.check(["a", "n"]) and not store.check(["a", "zz"])
    assert store.num_keys() == 3
    assert store.delete_key("a") and not store.delete_key("a")


def test_store_compare_set_follows_torch_semantics(store):
    assert store.compare_set("k", b"", b"v1") == b"v1"  # absent and expected empty: set
    assert store.compare_set("k", b"other", b"v2") == b"v1"  # mismatch: the current value
    assert store.compare_set("k", b"v1", b"v2") == b"v2"
    assert store.compare_set("absent", b"x", b"y") == b"x"  # absent: the expected value


def test_store_get_of_a_missing_key_times_out_naming_it(store):
    with pytest.raises(dist.DistStoreError) as e:
        store.get("late")
    assert str(e.value) == (
        "rendezvous get 'late': rendezvous key 'late': not set within 0.2 s "
        "(a peer of the group did not arrive)"
    )
    with pytest.raises(dist.DistStoreError):
        store.wait(["late"], datetime.timedelta(seconds=0.05))


def test_loopback_store_accepts_clients_on_loopback():
    master = loopback_store("127.0.0.1")
    client = dist.TCPStore("127.0.0.1", master.port, None, False, use_libuv=True)
    client.set("k", b"v")
    assert master.get("k") == b"v"
    assert [a for a, p in listening_addresses() if p == master.port] == ["127.0.0.1"]
    del client, master
