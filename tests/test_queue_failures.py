"""The queue fails fast, loud and whole: wrong addresses, dead peers, bad values, raw requests."""

import asyncio
import inspect
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

import rlferry.queue._client as client_module
from rlferry.queue import (
    GetTimeout,
    PutTimeout,
    Queue,
    QueueClient,
    QueueConfig,
    RemoteError,
    SchemaError,
    ServiceGone,
)
from rlferry.queue._serve import _run_unit, _started
from rlferry.wire import Client, SecurityError, Server, wire_loop
from rlferry.wire import RemoteError as WireRemoteError

SECRET = "a shared secret of the whole job"


@pytest.fixture
def q():
    with Queue.start(storage_units=2, tasks=("train",)) as queue:
        yield queue


# -- item 1: a client of a wrong or dead address ---------------------------------------------
def test_a_client_of_a_missing_ipc_path_fails_at_once_without_a_timeout():
    address = "ipc:///tmp/rlferry-test-no-queue.sock"
    with Queue.connect(address).client() as c, pytest.raises(ServiceGone) as e:
        c.put("p", {"x": torch.arange(3.0)})
    assert str(e.value) == (
        "no server at ipc:///tmp/rlferry-test-no-queue.sock: its socket file does not exist "
        "(is the server running, and is this the address it printed?)"
    )


def test_a_client_of_a_silent_address_fails_within_its_connect_timeout():
    with (
        QueueClient("tcp://127.0.0.1:9", connect_timeout=0.5) as c,
        pytest.raises(ServiceGone) as e,
    ):
        c.get("p", task="train", batch_size=1, fields=["x"])  # timeout=None: still bounded
    assert str(e.value) == (
        "tcp://127.0.0.1:9 never answered within 0.5 s (no server listens there: "
        "is it running, and is this the address it printed?)"
    )


def test_a_get_of_a_silent_address_fails_within_its_own_timeout_plus_the_reply_margin():
    with Queue.connect("tcp://127.0.0.1:9").client() as c, pytest.raises(ServiceGone) as e:
        c.get("p", task="train", batch_size=1, fields=["x"], timeout=1)
    assert str(e.value).startswith("tcp://127.0.0.1:9 never answered within 1.5 s")


@pytest.mark.parametrize("address", ["/tmp/q.sock", "127.0.0.1:5555", "queue"])
def test_an_address_without_a_scheme_is_refused_at_connect(address):
    with pytest.raises(SchemaError) as e:
        Queue.connect(address)
    assert str(e.value) == (
        f"address: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {address!r} "
        "(use the address the server printed, scheme included)"
    )


def test_a_client_with_the_wrong_secret_gets_a_security_error_naming_the_secret():
    with Queue.start(storage_units=1, bind="tcp://127.0.0.1:*", secret=SECRET) as q:
        wrong = Queue.connect(q.address, secret="another secret, 32 bytes long...")
        with wrong.client() as c, pytest.raises(SecurityError) as e:
            c.put("p", {"x": torch.zeros(1)})
        assert "this client's secret differs from the server's" in str(e.value)
        with Queue.connect(q.address, secret=SECRET).client() as c:
            assert c.put("p", {"x": torch.zeros(1)}) == [0]


# -- item 2: `rlferry serve queue` checks its config first and sees a unit die at once ---------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--bind", "tcp://127.0.0.1:*", "--secret", "S"],
            "SecurityError: secret: expected at least 16 bytes, got 1 "
            "(use e.g. `openssl rand -hex 32`)",
        ),
        (
            ["--bind", "tcp://0.0.0.0:*"],
            "SecurityError: bind 'tcp://0.0.0.0:*': a non-loopback bind needs a shared secret "
            "(pass secret=..., the same on every client; or bind tcp://127.0.0.1)",
        ),
        (["--tasks", "a,,b"], "SchemaError: tasks: expected distinct non-empty task names"),
        (["--lease-timeout", "0"], "SchemaError: lease_timeout: expected seconds > 0, got 0.0"),
    ],
)
def test_serve_queue_refuses_a_bad_config_before_starting_anything(args, error):
    out = subprocess.run(
        [sys.executable, "-m", "rlferry.cli", "serve", "queue", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"rlferry serve queue: {error}")


def test_serve_queue_help_documents_every_option_with_its_default():
    out = subprocess.run(
        [sys.executable, "-m", "rlferry.cli", "serve", "queue", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    text = " ".join(out.stdout.split())
    for option, default in [
        ("--storage-units", "2"),
        ("--tasks", "train"),
        ("--capacity", "None"),
        ("--max-partitions", "None"),
        ("--lease-timeout", "60.0"),
        ("--bind", "None"),
        ("--secret", "None"),
    ]:
        assert option in text
        assert f"(default: {default})" in text.split(option, 2)[-1]


def test_a_storage_unit_that_fails_to_start_is_reported_with_its_own_error():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_run_unit, args=("tcp://127.0.0.1:*", "short", child))
    proc.start()
    child.close()
    try:
        with pytest.raises(ServiceGone) as e:
            _started(0, proc, parent)
        assert str(e.value) == (
            "storage unit 0 failed to start: SecurityError: secret: expected at least 16 "
            "bytes, got 5 (use e.g. `openssl rand -hex 32`)"
        )
    finally:
        proc.join(30)


def _exit_silently() -> None:
    os._exit(3)


def test_a_storage_unit_that_dies_without_a_word_is_noticed_at_once():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_exit_silently)
    proc.start()
    child.close()
    with pytest.raises(ServiceGone) as e:
        _started(0, proc, parent)
    assert str(e.value) == "storage unit 0 died at start (exit code 3) before saying why"


def test_a_bad_config_names_its_field():
    with pytest.raises(SchemaError) as e:
        QueueConfig(tasks=("a", "a"))
    assert str(e.value) == (
        "tasks: expected distinct non-empty task names, got ('a', 'a') "
        "(e.g. ('actor_train', 'critic_train'))"
    )
    with pytest.raises(SchemaError) as e:
        QueueConfig(bind="localhost:5555")
    assert str(e.value).startswith("bind: expected tcp://HOST:PORT, ipc://PATH")
    with pytest.raises(SecurityError):
        QueueConfig(bind="tcp://127.0.0.1:*", secret="short")


# -- item 3: a misspelled field ---------------------------------------------------------------
def test_a_get_timeout_names_the_fields_the_partition_holds(q):
    c = q.client()
    c.put("p", {"tokens": torch.arange(4.0), "rewards": torch.zeros(4)})
    with pytest.raises(GetTimeout) as e:
        c.get("p", task="train", batch_size=2, fields=["token"], timeout=0.2)
    assert str(e.value) == (
        "get `p` for task `train`: 0 ready samples with fields ['token'] within 0.2 s, a batch "
        "needs 2 per rank x 1 ranks (partition `p` holds fields ['rewards', 'tokens']; no put "
        "brought ['token']: is a field name misspelled?)"
    )


def test_a_get_waiting_for_a_field_no_put_brought_warns_after_a_while(q, monkeypatch, caplog):
    monkeypatch.setattr(client_module, "WARN_AFTER", 0.2)
    c = q.client()
    c.put("p", {"tokens": torch.arange(4.0)})
    with caplog.at_level(logging.WARNING, logger="rlferry.queue"), pytest.raises(GetTimeout):
        c.get("p", task="train", batch_size=2, fields=["tokens", "token"], timeout=1.0)
    assert [r.getMessage() for r in caplog.records] == [
        "get `p` for task `train` has waited 0.2 s for fields ['token'] that no put of the "
        "partition brought yet (it holds ['tokens']): is a field name misspelled?"
    ]


# -- item 6: a consumer killed while parked ---------------------------------------------------
def _park_a_get(address: str, conn) -> None:
    async def main() -> None:
        c = Queue.connect(address).async_client()
        parked = asyncio.ensure_future(c.get("p", task="train", batch_size=2, fields=["x"]))
        for _ in range(2):  # the get's task runs, then its request's task sends it
            await asyncio.sleep(0)
        # the same socket, after the get: the controller answers this once the get parked
        conn.send((await c.statistics())["waiting_gets"])
        await parked

    asyncio.run(main())


def test_a_consumer_killed_while_parked_is_not_leased_anything():
    with Queue.start(storage_units=1, tasks=("train",), lease_timeout=60.0) as q:
        c = q.client()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_park_a_get, args=(q.address, child))
        proc.start()
        assert parent.poll(60) and parent.recv() == 1  # its get is parked at the controller
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        c.put("p", {"x": torch.arange(2.0)})
        b = c.get("p", task="train", batch_size=2, fields=["x"], timeout=10)
        assert b.data["x"].tolist() == [0.0, 1.0]  # not leased to the dead consumer
        assert c.statistics()["waiting_gets"] == 0


# -- item 7: a failed put holds nothing -------------------------------------------------------
def test_a_sparse_column_is_refused_by_name_and_reserves_nothing():
    with Queue.start(storage_units=1, tasks=("train",), capacity=4) as q:
        c = q.client()
        sparse = torch.eye(4).to_sparse()
        with pytest.raises(SchemaError) as e:
            c.put("p", {"x": torch.zeros(4), "s": sparse}, timeout=1)
        assert str(e.value) == (
            "field `s`: cannot travel: tensor layout torch.sparse_coo is not supported "
            "(dense or jagged nested only)"
        )
        assert c.put("p", {"x": torch.zeros(4)}, timeout=1) == [0, 1, 2, 3]  # all the room


def test_a_list_of_unsupported_tensors_is_refused_before_the_put(q):
    c = q.client()
    with pytest.raises(SchemaError) as e:
        c.put("p", {"t": [torch.ones(2), torch.eye(2).to_sparse()]})
    assert str(e.value).startswith("field `t`, at `$[1]`: cannot travel: tensor layout")
    assert c.statistics()["partitions"] == {}


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        (
            {"partition_meta": "ab"},
            "partition_meta: expected a dict with str keys, got 'ab' "
            "(e.g. {'num_microbatches': 4})",
        ),
        (
            {"partition_meta": {"f": object()}},
            "partition_meta, at `$.f`: type builtins.object",
        ),
        ({"meta": {"g": [object(), 1]}}, "meta `g`, at `$[0]`: type builtins.object"),
        ({"meta": {"g": [1]}}, "meta `g`: expected a list of 2 values (one per sample), got 1"),
        ({"timeout": -1}, "timeout: expected None or seconds >= 0, got -1"),
    ],
)
def test_a_put_with_bad_meta_raises_before_anything_is_reserved(q, kw, error):
    c = q.client()
    with pytest.raises(SchemaError) as e:
        c.put("p", {"x": torch.zeros(2)}, **kw)
    assert str(e.value).startswith(error)
    stats = c.statistics()
    assert stats["partitions"] == {} and stats["samples_held"] == 0


def test_a_put_whose_data_fails_after_the_reservation_gives_it_back(q):
    c = q.client()
    c.put("p", {"x": torch.zeros(2)})
    with pytest.raises(SchemaError):  # a field's kind changes: the controller refuses it
        c.put("p", {"x": torch.zeros(2, 3)})
    assert c.statistics()["samples_held"] == 2
    assert c.put("q", {"x": torch.zeros(1)}) == [2]


# -- item 8: remote errors keep their class ---------------------------------------------------
def test_a_remote_error_the_client_has_no_class_for_is_a_remote_error_not_service_gone():
    async def broken(value, peer):
        raise KeyError("the controller has a bug")

    srv = Server(broken, "tcp://127.0.0.1:*")
    address = wire_loop().run(srv.start())
    try:
        with Queue.connect(address).client() as c, pytest.raises(RemoteError) as e:
            c.clear("p")
        assert isinstance(e.value, WireRemoteError) and e.value.kind == "KeyError"
        assert str(e.value) == f"KeyError: 'the controller has a bug' (at {address})"
    finally:
        wire_loop().run(srv.close())


# -- items 9 and 10: the controller checks every request before it acts ------------------------
@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (
            {"op": "alloc", "partition": "p", "rows": -3, "signatures": {}},
            "request `alloc`: Expected `int` >= 1 - at `$.rows`",
        ),
        (
            {"op": "alloc", "partition": "p", "rows": 2, "signatures": {}, "partition_meta": "ab"},
            "request `alloc`: Expected `object | null`, got `str` - at `$.partition_meta`",
        ),
        (
            {"op": "get", "partition": "p", "task": "train", "fields": ["x"], "batch_size": 1,
             "dp_rank": 3, "dp_size": 2},
            "request `get`: dp_rank: expected an int in [0, 2), got 3",
        ),
        (
            {"op": "ack", "partition": "p", "task": "train", "lease": 1, "indexes": [1],
             "extra": 1},
            "request `ack`: Object contains unknown field `extra`",
        ),
    ],
)  # fmt: skip
def test_a_raw_request_that_does_not_fit_changes_nothing(q, request_, error):
    with Client(q.address) as raw, pytest.raises(WireRemoteError) as e:
        raw.request(request_, timeout=10)
    assert e.value.kind == "SchemaError" and e.value.message == error
    c = q.client()
    assert c.put("p", {"x": torch.zeros(2)}) == [0, 1]  # the index counter did not move
    assert c.statistics()["samples_held"] == 2


def test_the_controller_refuses_tensors_before_building_any(q):
    header_of_many = {"op": "stats", "x": [torch.ones(1)] * 100_000}
    with Client(q.address) as raw, pytest.raises(WireRemoteError) as e:
        raw.request(header_of_many, timeout=10)
    assert e.value.message == (
        "malformed message: a tensor, array or packed list in a message to a service that "
        "takes plain values only"
    )


def test_an_error_repr_of_a_huge_value_stays_short(q):
    c = q.client()
    with pytest.raises(SchemaError) as e:
        c.put("p", [torch.ones(1)] * 100_000)  # type: ignore[arg-type]
    assert len(str(e.value)) < 200 and str(e.value).startswith("data: expected a dict")


# -- structure: the sync client carries its real signatures ------------------------------------
def test_the_sync_client_shows_its_real_signatures():
    get = inspect.signature(QueueClient.get)
    assert list(get.parameters) == [
        "self", "partition", "task", "batch_size", "fields", "dp_rank", "dp_size", "sampler",
        "timeout",
    ]  # fmt: skip
    assert "Raises:" in (QueueClient.get.__doc__ or "")
    put = inspect.signature(QueueClient.put)
    assert list(put.parameters) == [
        "self", "partition", "data", "meta", "indexes", "partition_meta", "timeout",
    ]  # fmt: skip


def test_a_get_without_fields_names_the_sync_method(q):
    with pytest.raises(TypeError) as e:
        q.client().get("p", task="train", batch_size=1)  # type: ignore[call-arg]
    assert "QueueClient.get() missing 1 required keyword-only argument: 'fields'" in str(e.value)


def test_a_blocked_put_raises_put_timeout_when_its_timeout_is_over():
    with Queue.start(storage_units=1, tasks=("train",), capacity=2) as q:
        c = q.client()
        c.put("p", {"x": torch.zeros(2)})
        with pytest.raises(PutTimeout) as e:
            c.put("p", {"x": torch.zeros(1)}, timeout=0.3)
        assert str(e.value).startswith("put `p`: no room within 0.3 s (held 2 samples")


# -- item 11: socket files ----------------------------------------------------------------------
def _our_socket_files() -> set[str]:
    folder = tempfile.gettempdir()
    return {f for f in os.listdir(folder) if f.startswith(f"rlferry-{os.getpid()}-")}


def test_a_queue_removes_its_socket_files_when_it_closes():
    before = _our_socket_files()
    with Queue.start(storage_units=2, tasks=("train",)) as q:
        q.client().put("p", {"x": torch.zeros(1)})
        assert len(_our_socket_files() - before) == 3  # the controller and two units
    assert _our_socket_files() == before
