"""The broadcast transport on CPU: a gloo group formed by rlferry, 1 to 4 receivers."""

import asyncio
import concurrent.futures
import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from rlferry.weights import (
    PushTimeout,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
)
from rlferry.weights.protocol._messages import DONE, Ack, Stream, decode_request, encode
from rlferry.weights.sender import _hub, _pusher
from rlferry.weights.sender._hub import Hub
from rlferry.weights.transports import _groups
from test_weights import Engine, state


@pytest.fixture
def sender():
    s = WeightSender(group="g", transport="broadcast", receivers=1, bucket_bytes=256 << 10)
    yield s
    s.close()


def join(sender, engine, name, **kw):
    return WeightReceiver(
        group="g", address=sender.address, load=engine.load, name=name, **kw
    ).start()


@pytest.mark.parametrize("n", [1, 4])
def test_broadcast_delivers_every_push_to_every_receiver(n):
    sd = state()
    s = WeightSender(group="g", transport="broadcast", receivers=n, bucket_bytes=256 << 10)
    engines = [Engine(sd) for _ in range(n)]
    rs = [join(s, e, f"r{i}") for i, e in enumerate(engines)]
    for v in (1, 2):
        for t in sd.values():
            if t.dtype.is_floating_point:
                t.add_(1)
        report = s.push(sd.items(), version=v, timeout=60)
        assert report.receivers == tuple(f"r{i}" for i in range(n))
        assert all(e.equals(sd) for e in engines)
    assert s.statistics().groups_formed == 1  # formed once, reused
    assert s.statistics().started_on_lines == 1  # the second push: on the receivers' lines
    assert [r.statistics().groups_joined for r in rs] == [1] * n
    for r in rs:
        r.close()
    s.close()


def on_lines(sender):
    """A receiver that took two pushes, the second started on its line: its state, engine
    and receiver."""
    sd = state()
    e = Engine(sd)
    r = join(sender, e, "r0")
    for v in (1, 2):
        sender.push(sd.items(), version=v, timeout=60)
    assert sender.statistics().started_on_lines == 1
    return sd, e, r


def lines_of(pid):
    """The start lines (abstract datagram sockets) process ``pid``'s receivers listen on,
    as any process of this host finds them."""
    with open("/proc/net/unix") as f:
        return [w[1:] for line in f for w in line.split() if w.startswith(f"@rlferry-line-{pid}-")]


@pytest.mark.skipif(sys.platform != "linux", reason="start lines are Linux's abstract sockets")
def test_broadcast_a_start_on_a_line_from_another_process_or_malformed_is_dropped(sender, caplog):
    caplog.set_level(logging.WARNING, logger="rlferry.weights")
    sd, e, r = on_lines(sender)
    (line,) = lines_of(os.getpid())
    forged = encode(Stream(99, 99))  # a start of a push that does not exist
    code = (
        "import socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
        "[s.sendto(bytes.fromhex(h), '\\0' + sys.argv[1]) for h in sys.argv[2:]]"
    )
    subprocess.run([sys.executable, "-c", code, line, forged.hex(), "0102"], check=True)
    mine = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # the sender's process: taken,
    for junk in (b"\x01\x02", encode(Stream(1, 1))):  # but malformed, or a start of the past
        mine.sendto(junk, "\0" + line)
    mine.close()
    for t in sd.values():
        if t.dtype.is_floating_point:
            t.add_(1)
    assert sender.push(sd.items(), version=3, timeout=60).receivers == ("r0",)
    assert r.version == 3 and e.equals(sd) and sender.statistics().started_on_lines == 2
    said = [rec.getMessage() for rec in caplog.records]
    assert sum("(not the sender's)" in m for m in said) == 2, said
    assert sum("start line: dropped a malformed datagram" in m for m in said) == 1, said
    r.close()


def test_broadcast_a_failing_load_keeps_the_group_in_step():
    sender = WeightSender(group="g", transport="broadcast", receivers=2, bucket_bytes=256 << 10)
    sd = state()
    good = Engine(sd)
    calls = []

    def bad_load(items):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("bad shard")

    r0 = join(sender, good, "good")
    r1 = WeightReceiver(group="g", address=sender.address, load=bad_load, name="bad").start()
    with pytest.raises(WeightSyncError) as e:
        sender.push(sd.items(), version=1, timeout=60)
    assert list(e.value.failures) == ["bad"]
    assert e.value.failures["bad"].startswith("load raised ValueError: bad shard (at bucket 0 of ")
    assert e.value.report.receivers == ("good",) and good.equals(sd)
    # the failed receiver takes part again once it asked for work; a push that starts
    # before goes to the receivers ready (WeightSender.push), on a loaded machine "good"
    version, deadline = 1, time.monotonic() + 30
    while True:
        version += 1
        report = sender.push(sd.items(), version=version, timeout=60)
        if report.receivers == ("good", "bad") or time.monotonic() > deadline:
            break
    assert report.receivers == ("good", "bad")
    assert (r0.version, r1.version) == (version, version)
    r0.close()
    r1.close()
    sender.close()


def test_broadcast_a_new_receiver_forms_a_new_group(sender):
    sd = state()
    engines = [Engine(sd), Engine(sd)]
    r0 = join(sender, engines[0], "r0")
    sender.push(sd.items(), version=1, timeout=60)
    r1 = join(sender, engines[1], "r1")
    assert r1.wait_for(0, timeout=0) is False
    report = sender.push(sd.items(), version=2, timeout=60)
    assert report.receivers == ("r0", "r1") and engines[1].equals(sd)
    assert sender.statistics().groups_formed == 2
    r0.close()
    r1.close()


def test_broadcast_a_receiver_that_left_between_pushes_forms_a_new_group_of_the_others():
    # Pushes to receivers that hold the plan and the group start the fast way (in the hop
    # that picks them); one that left changes who is picked, and the push must form a
    # group of the others instead of streaming to the old one.
    sender = WeightSender(group="g", transport="broadcast", receivers=2, bucket_bytes=256 << 10)
    sd = state()
    engines = [Engine(sd), Engine(sd)]
    r0, r1 = join(sender, engines[0], "r0"), join(sender, engines[1], "r1")
    for v in (1, 2):
        assert sender.push(sd.items(), version=v, timeout=60).receivers == ("r0", "r1")
    r1.close()
    for t in sd.values():
        if t.dtype.is_floating_point:
            t.add_(1)
    assert sender.push(sd.items(), version=3, timeout=60).receivers == ("r0",)
    assert engines[0].equals(sd) and r0.version == 3 and r1.version == 2
    assert sender.statistics().groups_formed == 2
    r0.close()
    sender.close()


def test_broadcast_verify_sends_the_checksums_as_a_last_collective(sender):
    sd = state()
    e = Engine(sd)
    r = join(sender, e, "r0", verify=True)
    sender.push(sd.items(), version=1, timeout=60)
    assert e.equals(sd) and r.version == 1 and r.statistics().last_error is None
    r.close()


def test_broadcast_cpu_tensors_use_gloo_and_the_buffers_stay_on_cpu(sender):
    sd = {"w": torch.randn(10)}
    e = Engine(sd)
    r = join(sender, e, "r0")
    sender.push(sd.items(), version=1, timeout=60)
    assert e.equals(sd) and sender.statistics().buffer_bytes == 2 * 256
    r.close()


@pytest.mark.slow
def test_broadcast_a_push_past_its_timeout_raises_push_timeout_and_the_next_forms_a_new_group():
    s = WeightSender(group="g", transport="broadcast", bucket_bytes=4096)
    gate = threading.Event()
    sd = {f"w{i}": torch.randn(1024) for i in range(8)}  # 8 buckets
    params = {n: torch.zeros_like(t) for n, t in sd.items()}

    def load(items):
        gate.wait()  # stuck: the sender's gloo wait runs out
        for n, t in items:
            params[n].copy_(t)

    r = WeightReceiver(group="g", address=s.address, load=load, name="r0").start()
    with pytest.raises(PushTimeout) as e:
        s.push(sd.items(), version=1, timeout=2)
    assert str(e.value).startswith("push of version 1: the broadcast of bucket ")
    assert "of 8 did not finish within the push's timeout: " in str(e.value)
    gate.set()
    assert s.push(sd.items(), version=2, timeout=30).receivers == ("r0",)
    assert r.version == 2 and all(torch.equal(params[n], t) for n, t in sd.items())
    assert s.statistics().groups_formed == 2
    r.close()
    s.close()


def test_broadcast_a_bad_tensor_in_the_first_bucket_fails_that_push_and_the_next_works(sender):
    # From the second push on, bucket 0 is packed while the loop picks the receivers and
    # starts their stream: a tensor that fails its check there must abort that started
    # push (the receiver keeps its version), and the next push must work.
    sd, e, r = on_lines(sender)
    layout = list(sd.items())
    bad = ((n, t[:1] if i == 0 else t) for i, (n, t) in enumerate(sd.items()))
    with pytest.raises(WeightSyncError) as err:
        sender.push(bad, version=3, timeout=30, layout=layout)
    assert str(err.value).startswith("push of version 3: named_tensors[0]: expected `")
    assert r.version == 2
    for t in sd.values():
        if t.dtype.is_floating_point:
            t.add_(1)
    assert sender.push(sd.items(), version=4, timeout=60).receivers == ("r0",)
    assert r.version == 4 and e.equals(sd)
    r.close()


def test_broadcast_a_push_ends_on_the_receivers_word_on_the_group_the_next_waits_for_their_acks(
    monkeypatch,
):
    """Every receiver says on the group that it committed (an all-reduce, the push's last
    exchange): the push ends then, its acks on their way; the next push waits for them."""
    gate, held, keys = threading.Event(), [], set()
    handle = Hub.handle

    async def held_handle(self, value, peer):  # the sender takes r1's commit acks late
        msg = decode_request(value)
        if peer in keys and isinstance(msg, Ack) and msg.step == DONE and msg.seq == 2:
            held.append(msg.seq)
            await asyncio.get_running_loop().run_in_executor(None, gate.wait)
        return await handle(self, value, peer)

    monkeypatch.setattr(Hub, "handle", held_handle)
    monkeypatch.setattr(_hub, "JOIN_GRACE", 30.0)  # how long the next push waits for it
    sd = state()
    engines = [Engine(sd), Engine(sd)]
    s = WeightSender(group="g", transport="broadcast", receivers=2, bucket_bytes=256 << 10)
    rs = [join(s, e, f"r{i}") for i, e in enumerate(engines)]
    try:
        gate.set()
        s.push(sd.items(), version=1, timeout=60)
        gate.clear()
        keys.add(rs[1]._conn.key)
        # the sender cannot have taken r1's ack of version 2 (held, or not come yet)
        assert s.push(sd.items(), version=2, timeout=60).receivers == ("r0", "r1")
        assert rs[1].version == 2 and all(e.equals(sd) for e in engines)
        threading.Timer(1.0, gate.set).start()
        assert s.push(sd.items(), version=3, timeout=60).receivers == ("r0", "r1")
        assert [r.version for r in rs] == [3, 3] and held == [2]
    finally:
        gate.set()
        for r in rs:
            r.close()
        s.close()


def test_broadcast_a_failing_on_commit_is_said_on_the_group_and_named_by_its_ack():
    s = WeightSender(group="g", transport="broadcast", receivers=2, bucket_bytes=256 << 10)
    sd = state()
    good, bad = Engine(sd), Engine(sd)

    def refuse(version):
        if version == 1:
            raise RuntimeError("engine refused version 1")

    r0 = join(s, good, "good")
    r1 = join(s, bad, "bad", on_commit=refuse)
    with pytest.raises(WeightSyncError) as e:
        s.push(sd.items(), version=1, timeout=60)
    assert e.value.failures == {"bad": "on_commit raised RuntimeError: engine refused version 1"}
    assert r0.version == 1 and r1.version is None
    assert sorted(s.push(sd.items(), version=2, timeout=60).receivers) == ["bad", "good"]
    assert r1.version == 2 and bad.equals(sd)
    r0.close()
    r1.close()
    s.close()


@pytest.mark.parametrize("seen", [True, False], ids=["kept", "unseen"])
def test_a_gloo_group_dropped_with_work_its_peer_never_joins_goes_without_blocking(seen):
    # A push given up mid-stream can leave work on a link's gloo group that its peer never
    # joins (the sender's outcome all-reduce while a receiver is held in its load); gloo's
    # destructor waits for pending work until the group's timeout, so the one dropping the
    # group (a sender forming its next one) must not be the one that waits. Work posted as
    # a Ctrl-C landed may not have been kept ("unseen"): a group given up mid-push goes
    # off the thread all the same.
    store = dist.HashStore()
    groups = [None, None]

    def make(rank):
        groups[rank] = _groups.make_group("gloo", store, "t", rank, 2, 30.0, "127.0.0.1", True)

    ts = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    mine, peers = groups
    groups[0] = None
    work = mine.allreduce([torch.zeros(1)])  # the peer never joins it
    before = set(threading.enumerate())
    held = [mine]  # the only reference: _release takes it
    del mine
    _groups.release(held, [work] if seen else [], broken=not seen)
    assert not work.is_completed()  # returned with the work still pending
    (waiter,) = [t for t in threading.enumerate()
                 if t not in before and t.name == "rlferry-gloo-release"]  # fmt: skip
    assert waiter.is_alive()
    peers_work = peers.allreduce([torch.ones(1)])  # the peer joins late: the work ends
    peers_work.wait(datetime.timedelta(seconds=30))
    waiter.join(30)
    assert not waiter.is_alive() and work.is_completed()


def bumped(sd, d):
    return {k: v + d if v.dtype.is_floating_point else v for k, v in sd.items()}


@pytest.mark.parametrize(
    "way, lands",
    [("hub", "told_late"), ("hub", "after_submit"), ("lines", "after_submit"),
     ("lines", "before_submit")],
)  # fmt: skip
def test_broadcast_an_interrupt_as_the_push_starts_aborts_whatever_started(
    sender, monkeypatch, way, lands
):
    """A Ctrl-C that lands as the push starts, wherever, leaves no receiver streaming: the
    push the hub started, or whose starts went on the receivers' lines, is aborted; a
    begin not yet run never starts. The receiver keeps its version; the next push works.
    A push started by a begin whose future is not yet told (``told_late``) or lost (a
    Ctrl-C in its submission to the loop) is aborted too: left, the receiver would take
    the next push's buckets as this one's, then wait for buckets never sent."""
    sd, e, r = on_lines(sender)
    launcher, loop = sender._pusher.launcher, sender._pusher.parts.loop
    begin, submit = launcher.begin, loop.submit
    if way == "hub":
        launcher.committed = None  # the push starts through the hub, on the loop

    def started_not_yet_told(fast, args, wait_for, deadline):
        real, lined = begin(fast, args, wait_for, deadline)
        assert real.result(60)[1] is not None and not lined  # the start went
        return concurrent.futures.Future(), False  # its result not yet passed on

    def interrupted_submit(coro):
        if coro.cr_code.co_name not in ("begin", "begin_direct"):
            return submit(coro)
        if lands == "before_submit":
            coro.close()
        else:
            submit(coro)
        raise KeyboardInterrupt

    if lands == "told_late":
        monkeypatch.setattr(launcher, "begin", started_not_yet_told)
        monkeypatch.setattr(_pusher, "_sent", lambda begun, deadline: _raise(KeyboardInterrupt))
    else:
        monkeypatch.setattr(loop, "submit", interrupted_submit)
    interrupted_then_the_next_works(sender, monkeypatch, r, e, sd, 3)
    r.close()


def _raise(e):
    raise e


def interrupted_then_the_next_works(sender, monkeypatch, r, e, sd, version):
    """Push ``version`` (the interrupt patched in lands in it): the receiver keeps the one
    before; once the patches are gone, the next push reaches it whole."""
    with pytest.raises(KeyboardInterrupt):
        sender.push(bumped(sd, 1).items(), version=version, timeout=60)
    monkeypatch.undo()
    assert r.version == version - 1 and e.equals(sd)
    sd = bumped(sd, 2)
    assert sender.push(sd.items(), version=version + 1, timeout=60).receivers == ("r0",)
    assert r.version == version + 1 and e.equals(sd)


def test_broadcast_a_push_interrupted_mid_stream_ends_its_receivers_stream_at_once(sender):
    """A Ctrl-C mid-stream: the sender aborts the push and its receiver's stream ends at once
    (its watch cuts the gloo waits), even while something still holds the sender's group
    (a traceback, until the garbage collector takes it): the receiver keeps its version
    and the next push works: it does not wait the group's timeout for a bucket never
    sent, and the next push does not find it busy."""
    sd, e, r = on_lines(sender)
    steps = sender._pusher.steps(bumped(sd, 1).items(), version=3, timeout=60)
    next(steps)  # the push started and bucket 0 went
    next(steps)  # bucket 1 too
    held = sender._pusher.parts.collective._pg  # the group's sockets stay open
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        steps.throw(KeyboardInterrupt)
    sd = bumped(sd, 2)
    assert sender.push(sd.items(), version=4, timeout=60).receivers == ("r0",)
    assert time.monotonic() - t0 < 30  # the receiver did not wait out its 60 s
    assert r.version == 4 and e.equals(sd) and r.statistics().groups_joined == 2
    del held
    r.close()


def test_broadcast_an_interrupt_as_the_hub_starts_a_push_aborts_it(sender, monkeypatch):
    """A Ctrl-C while the wire loop starts the push (a receiver that verifies is started
    through the hub, after its begin) aborts it: the receiver keeps its version and the
    next push works: left started, the receiver would stream it still and take the next
    push's buckets as this one's."""
    sd = state()
    e = Engine(sd)
    r = join(sender, e, "r0", verify=True)
    sender.push(sd.items(), version=1, timeout=60)
    loop = sender._pusher.parts.loop
    submit = loop.submit

    def interrupted(coro):
        fut = submit(coro)
        if coro.cr_code.co_name == "start":
            fut.result(60)  # it ran: the receiver was told to stream
            raise KeyboardInterrupt
        return fut

    monkeypatch.setattr(loop, "submit", interrupted)
    interrupted_then_the_next_works(sender, monkeypatch, r, e, sd, 2)
    r.close()


def test_broadcast_a_receiver_that_rejects_the_plan_fails_the_push_at_once_naming_it():
    """Over broadcast as over shm: a receiver that rejects the plan fails the push at once,
    named, no bucket moved. It joins the group all the same (a group forms once every
    member joined), so the sender does not wait for it to join until the push's timeout,
    and its error names it, not only the others' failed joins."""
    s = WeightSender(group="g", transport="broadcast", receivers=2, bucket_bytes=256 << 10)
    sd = state()
    good = Engine(sd)
    r0 = join(s, good, "good")
    r1 = join(s, Engine(sd), "bad", expected={"w": torch.zeros(3, 3)})
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as e:
            s.push(sd.items(), version=1, timeout=60)
        assert time.monotonic() - t0 < 30  # not the push's timeout
        assert list(e.value.failures) == ["bad"]
        assert e.value.failures["bad"].startswith("rejected the plan: ")
        assert str(e.value).endswith("; no bucket moved")
        assert (r0.version, r1.version) == (None, None)
        r1.close()
        assert s.push(sd.items(), version=2, timeout=60).receivers == ("good",)
        assert r0.version == 2 and good.equals(sd)
    finally:
        r0.close()
        r1.close()
        s.close()
