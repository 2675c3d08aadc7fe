"""Request/reply sockets: replies, timeouts, closed and broken channels, secrets, shared memory."""

import asyncio
import concurrent.futures
import multiprocessing as mp
import os
import signal
import socket
import threading

import pytest
import torch

from rlferry.wire import (
    AsyncClient,
    ChannelClosed,
    Client,
    PeerGone,
    RemoteError,
    RequestTimeout,
    SecurityError,
    Server,
    default_address,
    wire_loop,
)
from rlferry.wire.memory._segments import AVAILABLE as SHM
from rlferry.wire.memory._segments import exports

SECRET = "0123456789abcdef0123456789abcdef"


async def echo(value, peer):
    if value == "boom":
        raise ValueError("the handler failed")
    if value == "hang":
        await asyncio.Event().wait()
    return value


@pytest.fixture(params=["tcp", "ipc"])
def server(request):
    srv = Server(echo, default_address(request.param))
    wire_loop().run(srv.start())
    yield srv
    wire_loop().run(srv.aclose())


def test_default_bind_is_loopback_on_a_free_port():
    srv = Server(echo)
    address = wire_loop().run(srv.start())
    try:
        assert address.startswith("tcp://127.0.0.1:") and int(address.rsplit(":", 1)[1]) > 0
    finally:
        wire_loop().run(srv.aclose())


def test_request_gets_the_reply(server):
    with Client(server.address) as c:
        value = {"x": torch.arange(10), "s": "hi", "big": torch.ones(1 << 18)}
        out = c.request(value, timeout=10)
        assert torch.equal(out["x"], value["x"]) and out["s"] == "hi"
        assert torch.equal(out["big"], value["big"])


def test_handler_error_comes_back_named(server):
    with Client(server.address) as c, pytest.raises(RemoteError) as e:
        c.request("boom", timeout=10)
    assert e.value.kind == "ValueError" and str(e.value) == "ValueError: the handler failed"


def test_timeout_raises_a_timeout_error(server):
    with Client(server.address) as c, pytest.raises(RequestTimeout) as e:
        c.request("hang", timeout=0.2)
    assert isinstance(e.value, TimeoutError)
    assert str(e.value) == f"no reply from {server.address} within 0.2 s"


def test_nobody_listening_is_never_answered_within_the_request_timeout():
    with Client("tcp://127.0.0.1:9") as c, pytest.raises(PeerGone) as e:
        c.request(1, timeout=0.2)
    assert str(e.value) == (
        "tcp://127.0.0.1:9 never answered within 0.2 s (no server listens there: "
        "is it running, and is this the address it printed?)"
    )


def test_nobody_listening_fails_after_the_connect_timeout_without_a_request_timeout():
    with Client("tcp://127.0.0.1:9", connect_timeout=0.3) as c:
        with pytest.raises(PeerGone) as e:
            c.request(1, timeout=None)
        assert "never answered within 0.3 s" in str(e.value)
        with pytest.raises(PeerGone):  # later requests fail at once while nobody answers
            c.request(1, timeout=None)


def test_an_ipc_path_without_a_socket_file_is_refused_at_once():
    with Client("ipc:///tmp/rlferry-test-nobody-here.sock") as c, pytest.raises(PeerGone) as e:
        c.request(1, timeout=None)
    assert str(e.value) == (
        "no server at ipc:///tmp/rlferry-test-nobody-here.sock: its socket file does not "
        "exist (is the server running, and is this the address it printed?)"
    )


@pytest.mark.parametrize("address", ["/tmp/x.sock", "127.0.0.1:5555", "http://h:1", "tcp://h"])
def test_an_address_without_a_known_scheme_is_refused_by_the_constructor(address):
    with pytest.raises(ValueError) as e:
        Client(address)
    assert str(e.value).startswith("address: expected tcp://HOST:PORT")
    assert repr(address) in str(e.value)


def test_an_ipc_server_removes_its_socket_file_on_close():
    srv = Server(echo, default_address("ipc"))
    path = wire_loop().run(srv.start()).removeprefix("ipc://")
    assert os.path.exists(path)
    wire_loop().run(srv.aclose())
    assert not os.path.exists(path)


def test_socket_files_of_dead_processes_are_swept_at_the_next_start(tmp_path, monkeypatch):
    import rlferry.wire._address as address

    proc = mp.get_context("spawn").Process(target=os.getpid)
    proc.start()
    proc.join()
    dead = tmp_path / f"rlferry-{proc.pid}-0123456789ab.sock"
    alive = tmp_path / f"rlferry-{os.getpid()}-0123456789ab.sock"
    other = tmp_path / "someone-else.sock"
    for f in (dead, alive, other):
        f.write_bytes(b"")
    monkeypatch.setattr(address.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(address, "_swept", False)
    assert default_address("ipc").startswith(f"ipc://{tmp_path}/rlferry-{os.getpid()}-")
    assert not dead.exists() and alive.exists() and other.exists()


def test_closed_client_raises_channel_closed(server):
    c = Client(server.address)
    c.close()
    with pytest.raises(ChannelClosed, match="is closed"):
        c.request(1, timeout=1)


def test_close_wakes_a_waiting_request(server):
    async def scenario():
        c = AsyncClient(server.address)
        waiting = asyncio.ensure_future(c.request("hang", timeout=30))
        await asyncio.sleep(0.1)  # allowed: lets the request reach the server
        await c.aclose()
        with pytest.raises(ChannelClosed, match="was closed"):
            await waiting

    asyncio.run(scenario())


def test_a_server_in_async_with_serves_inside_and_is_closed_after():
    async def scenario():
        async with Server(echo, default_address("ipc")) as srv:
            async with AsyncClient(srv.address) as c:
                assert await c.request("hi", timeout=10) == "hi"
            with pytest.raises(ChannelClosed, match="is closed"):
                await c.request("hi", timeout=10)
        with pytest.raises(ChannelClosed, match="is closed"):
            await srv.start()
        await srv.aclose()  # a second close does nothing
        await c.aclose()

    asyncio.run(scenario())


def test_a_second_start_returns_the_bound_address():
    async def scenario():
        async with Server(echo) as srv:
            assert await srv.start() == srv.address

    asyncio.run(scenario())


def test_the_old_async_close_names_aclose_and_still_closes():
    async def scenario():
        srv = Server(echo)
        await srv.start()
        c = AsyncClient(srv.address)
        assert await c.request(1, timeout=10) == 1
        with pytest.warns(DeprecationWarning, match=r"use `await AsyncClient.aclose\(\)`"):
            await c.close()
        with pytest.raises(ChannelClosed):
            await c.request(1, timeout=10)
        with pytest.warns(DeprecationWarning, match=r"use `await Server.aclose\(\)`"):
            await srv.close()
        with pytest.raises(ChannelClosed):
            await srv.start()

    asyncio.run(scenario())


def test_a_sync_clients_second_close_does_nothing(server):
    c = Client(server.address)
    assert c.request(2, timeout=10) == 2
    c.close()
    c.close()
    with pytest.raises(ChannelClosed, match="is closed"):
        c.request(1, timeout=1)


def test_shared_memory_statistics_are_a_frozen_record():
    stats = exports.statistics()
    assert stats.segments >= 0 and stats.exports >= 0 and stats.free_bytes <= stats.segment_bytes
    with pytest.raises(AttributeError):
        stats.segments = 1


def test_sync_close_from_another_thread_ends_a_wait_at_once(server):
    c = Client(server.address)
    rid = c.send("hang")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(c.wait, rid, 30)
        with pytest.raises(concurrent.futures.TimeoutError):
            waiting.result(timeout=0.2)  # it waits on its socket...
        c.close()  # ...until another thread closes the client
        with pytest.raises(ChannelClosed, match="was closed"):
            waiting.result(timeout=5)


def test_sync_requests_in_flight_are_collected_in_any_order_and_unread_replies_dropped(server):
    with Client(server.address) as c:
        a, b = c.send("a"), c.send({"b": torch.ones(1 << 18)})  # b is large: shared memory
        c.send("dropped", reply=False)
        assert torch.equal(c.wait(b, 10)["b"], torch.ones(1 << 18))
        assert c.wait(a, 10) == "a"
        assert c.request("after", timeout=10) == "after"
        with pytest.raises(RequestTimeout):
            c.wait(c.send("hang"), 0.1)
        assert c.request("after a timeout", timeout=10) == "after a timeout"
        read, unread = c.send("once"), c.send("never", reply=False)
        assert c.wait(read, 10) == "once"
        for rid in (read, unread):  # a reply is read once; an unawaited one never
            with pytest.raises(ValueError, match="wait: expected the id of a request sent"):
                c.wait(rid, 10)


def test_a_sync_wait_ends_when_the_callers_own_socket_is_readable_and_the_reply_stays_awaited(
    server,
):
    mine, other = socket.socketpair()
    with Client(server.address) as c, mine, other:
        rid = c.send("hang")  # never answered: only the caller's socket ends the wait
        other.send(b"x")
        assert c.wait(rid, 10, also=mine) is None
        assert mine.recv(1) == b"x"
        with pytest.raises(RequestTimeout):  # still awaited; its reply is read once
            c.wait(rid, 0.1, also=mine.fileno())
        done = c.send("answered")
        assert c.wait(done, 10, also=mine) == "answered"  # a reply ends it as before
        with pytest.raises(ValueError, match="also: expected a socket or a file descriptor"):
            c.wait(c.send("x"), 10, also="mine")


def test_sync_close_sends_its_farewell_first():
    seen = []

    async def note(value, peer):
        seen.append(value)
        return "bye" if value == "farewell" else value

    srv = Server(note)
    address = wire_loop().run(srv.start())
    try:
        c = Client(address)
        assert c.request("hello", timeout=10) == "hello"
        c.close(farewell="farewell")
        assert seen == ["hello", "farewell"]
        with pytest.raises(ChannelClosed, match="is closed"):
            c.request("again", timeout=1)
    finally:
        wire_loop().run(srv.aclose())


def _serve_forever(transport, conn):
    async def main():
        srv = Server(echo, default_address(transport))
        conn.send(await srv.start())
        await asyncio.Event().wait()

    asyncio.run(main())


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_killed_server_raises_peer_gone_not_a_hang(transport):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_forever, args=(transport, child), daemon=True)
    proc.start()
    assert parent.poll(60)
    address = parent.recv()
    with Client(address) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert c.request("ping", timeout=30) == "ping"
        rid = c.send("hang")
        fut = pool.submit(c.wait, rid, 30)
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(PeerGone, match="disconnected"):
            fut.result(timeout=20)
    proc.join(5)


def test_non_loopback_bind_needs_a_secret():
    with pytest.raises(SecurityError) as e:
        Server(echo, "tcp://0.0.0.0:0")
    assert str(e.value) == (
        "bind 'tcp://0.0.0.0:0': a non-loopback bind needs a shared secret "
        "(pass secret=..., the same on every client; or bind tcp://127.0.0.1)"
    )


def test_short_secret_is_refused():
    with pytest.raises(SecurityError, match="secret: expected at least 16 bytes, got 5"):
        wire_loop().run(Server(echo, "tcp://0.0.0.0:0", secret="short").start())


def test_curve_secret_lets_the_right_client_in_and_keeps_others_out():
    srv = Server(echo, "tcp://127.0.0.1:*", secret=SECRET)
    address = wire_loop().run(srv.start())
    try:
        with Client(address, secret=SECRET) as good:
            assert good.request("ok", timeout=10) == "ok"
        with (
            Client(address, secret="another secret of 32 bytes......") as bad,
            pytest.raises(SecurityError) as e,
        ):
            bad.request("ok", timeout=None)
        assert str(e.value) == (
            f"{address} refused this client's handshake: this client's secret differs from "
            "the server's, or the server has none (pass the secret the server was started "
            "with, or none)"
        )
        with Client(address) as plain, pytest.raises(SecurityError) as e:
            plain.request("ok", timeout=None)
        assert str(e.value) == (
            f"{address} refused this client's handshake: the server requires a secret and "
            "this client has none (pass secret=)"
        )
    finally:
        wire_loop().run(srv.aclose())


@pytest.mark.skipif(not SHM, reason="shared-memory frames need Linux memfd")
def test_ipc_large_frames_travel_in_shared_memory_and_the_segment_is_reused():
    kept = []

    async def keep(value, peer):
        if value == "sync":
            return 0
        kept.append(value)
        return value["x"].data_ptr()

    srv = Server(keep, default_address("ipc"))
    address = wire_loop().run(srv.start())
    try:
        with Client(address) as c:
            x = torch.randn(1 << 20)
            ptr = c.request({"x": x}, timeout=10)
            # the server's tensor lies in shared memory, not in a socket buffer
            assert exports.find(ptr, x.numel() * 4) is not None
            assert torch.equal(kept[0]["x"], x)
            lent = exports.statistics().exports
            assert lent >= 1
            kept.clear()  # the server drops its views: the release comes back
            c.request("sync", timeout=10)
            c.request("sync", timeout=10)
            assert exports.statistics().exports == lent - 1
            before = exports.statistics().segments
            for _ in range(3):
                c.request({"x": x}, timeout=10)
                kept.clear()
            assert exports.statistics().segments <= before + 1  # warm segments reused
    finally:
        wire_loop().run(srv.aclose())


@pytest.mark.skipif(not SHM, reason="shared-memory frames need Linux memfd")
def test_a_sync_clients_dropped_large_reply_goes_back_to_the_server():
    big = torch.randn(1 << 20)

    async def give(value, peer):
        return {"x": big} if value == "big" else 0

    srv = Server(give, default_address("ipc"))
    address = wire_loop().run(srv.start())
    try:
        with Client(address) as c:
            before = exports.statistics().exports
            got = c.request("big", timeout=10)
            assert torch.equal(got["x"], big)
            assert exports.statistics().exports == before + 1  # lent to this client
            del got  # the views die: a release is owed, sent with the client's next message
            c.request("sync", timeout=10)
            c.request("sync", timeout=10)
            assert exports.statistics().exports == before
    finally:
        wire_loop().run(srv.aclose())


def test_a_sync_wait_after_a_wake_up_sleeps_until_its_reply_or_its_timeout():
    # a release owed (a lent reply dropped) writes the client's wake-up socket; a wait
    # that then reads no reply must sleep, not poll again at once until it comes
    big = torch.randn(1 << 20)

    async def give(value, peer):
        if value == "hang":
            await asyncio.Event().wait()
        return {"x": big} if value == "big" else 0

    srv = Server(give, default_address("ipc"))
    address = wire_loop().run(srv.start())
    try:
        with Client(address) as c:
            got = c.request("big", timeout=10)
            del got  # a release is owed: the client is woken to send it
            rid = c.send("hang")
            polls = []
            pump = c._pump
            c._pump = lambda seconds, also=None: polls.append(seconds) or pump(seconds, also)
            with pytest.raises(RequestTimeout):
                c.wait(rid, 0.5)
            assert 1 <= len(polls) <= 3, f"{len(polls)} polls in a 0.5 s wait"
    finally:
        wire_loop().run(srv.aclose())


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_servers_made_and_closed_in_a_row_all_answer(transport):
    # Regression: monitors named after a reused fd collided with a closed socket's monitor
    # and, under load, left the new server deaf. Each request here must be answered.
    for i in range(50):
        srv = Server(echo, default_address(transport))
        address = wire_loop().run(srv.start())
        with Client(address) as c:
            assert c.request(i, timeout=10) == i
        wire_loop().run(srv.aclose())


def _park_clients_then_wait(address, n, conn):
    clients = [Client(address) for _ in range(n)]
    for i, c in enumerate(clients):
        c.send(f"park{i}")
    conn.send("parked")
    conn.recv()  # killed while waiting here


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_disconnect_names_the_dead_clients_never_live_ones_that_took_their_sockets(transport):
    # The OS hands a new connection the lowest free socket number: clients that connect as
    # others die get the dead ones' numbers. Every dead client is reported once; no live one.
    peers: dict[str, bytes] = {}
    gone: list[bytes] = []
    reported = threading.Condition()

    async def handler(value, peer):
        with reported:
            peers[value] = peer
            reported.notify_all()
        if value.startswith("park"):
            await asyncio.Event().wait()
        return value

    def on_disconnect(peer):
        with reported:
            gone.append(peer)
            reported.notify_all()

    srv = Server(handler, default_address(transport), on_disconnect=on_disconnect)
    address = wire_loop().run(srv.start())
    n = 8
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_park_clients_then_wait, args=(address, n, child), daemon=True)
    live = []
    try:
        proc.start()
        assert parent.poll(60) and parent.recv() == "parked"
        with reported:
            assert reported.wait_for(lambda: len(peers) == n, 30)
        os.kill(proc.pid, signal.SIGKILL)
        live = [Client(address) for _ in range(n)]
        assert [c.request(f"live{i}", timeout=30) for i, c in enumerate(live)] == [
            f"live{i}" for i in range(n)
        ]
        dead = {peers[f"park{i}"] for i in range(n)}
        with reported:
            assert reported.wait_for(lambda: dead <= set(gone), 30), "a dead client not reported"
            assert not {peers[f"live{i}"] for i in range(n)} & set(gone), "a live one reported"
            assert len(gone) == n
    finally:
        for c in live:
            c.close()
        proc.join(5)
        wire_loop().run(srv.aclose())
