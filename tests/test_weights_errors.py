"""How a sender and a receiver end: closed, gone, timed out, failed; and what a failed push
leaves behind (nothing)."""

import threading
import time

import pytest
import torch

from rlferry.weights import (
    PushTimeout,
    ReceiverClosed,
    SenderClosed,
    SenderGone,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
)
from rlferry.weights.protocol._messages import Join, Welcome, decode_request, encode
from rlferry.wire import Server, default_address, wire_loop


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(128, 256, generator=g) for i in range(4)}


class Engine:
    def __init__(self, like):
        self.params = {n: torch.zeros_like(t) for n, t in like.items()}

    def load(self, items):
        for n, t in items:
            self.params[n].copy_(t)

    def equals(self, sd):
        return all(torch.equal(self.params[n], t) for n, t in sd.items())


def receiver(sender, name="r0", **kw):
    kw.setdefault("load", Engine(weights()).load)
    return WeightReceiver(group="g", address=sender.address, name=name, **kw).start()


# -- the receiver's end of life ---------------------------------------------------------------


def test_wait_for_raises_sender_gone_once_the_sender_closed():
    s = WeightSender(group="g", transport="shm")
    r = receiver(s)
    s.push(weights().items(), version=1, timeout=30)
    address = s.address
    s.close()
    t0 = time.monotonic()
    with pytest.raises(SenderGone) as e:
        r.wait_for(2, timeout=30)
    assert time.monotonic() - t0 < 10  # seen, not waited out
    reason = (
        f"the sender at {address} went away (it closed or died); this receiver stays at "
        "version 1 (join the next sender with a new WeightReceiver)"
    )
    assert str(e.value) == f"receiver `r0` cannot reach version 2: {reason}"
    assert r.statistics().stopped == reason
    assert r.wait_for(1, timeout=30)  # a version it holds is still there
    r.close()


def test_wait_for_raises_receiver_closed_in_a_waiting_thread_at_once():
    s = WeightSender(group="g", transport="shm")
    r = receiver(s)
    got = {}

    def wait():
        try:
            r.wait_for(1, timeout=30)
        except ReceiverClosed as e:
            got["error"], got["at"] = e, time.monotonic()

    t = threading.Thread(target=wait)
    t.start()
    closed = time.monotonic()
    r.close()
    t.join(30)
    assert got["at"] - closed < 5
    assert str(got["error"]) == (
        "receiver `r0` cannot reach version 1: it is closed (at version None)"
    )
    assert r.statistics().stopped == "it is closed (at version None)"
    with pytest.raises(ReceiverClosed) as e:
        r.start()
    assert str(e.value) == "receiver `r0` is closed (make a new WeightReceiver to join again)"
    s.close()


def _fake_sender(answer):
    """A wire service that welcomes a receiver of group 'g' (shm) and answers the rest
    with ``answer(value)``."""

    async def handle(value, peer):
        if isinstance(decode_request(value), Join):
            return encode(Welcome("g", "shm"))
        return await answer(value)

    server = Server(handle, default_address("ipc"))
    return server, wire_loop().run(server.start())


def test_a_receiver_whose_thread_fails_says_so_in_wait_for_and_statistics():
    async def garbage(value):
        return b"\xc1"  # not MessagePack: the receiver's thread cannot decode it

    server, address = _fake_sender(garbage)
    r = WeightReceiver(group="g", address=address, load=print, name="r0").start()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as e:
        r.wait_for(1, timeout=30)
    assert time.monotonic() - t0 < 10
    reason = (
        "its thread failed: DecodeError: MessagePack data is malformed: invalid opcode "
        "'\\xc1' (byte 0) (a sender of another rlferry version, or a bug: please report it); "
        "this receiver stays at version None"
    )
    assert type(e.value) is WeightSyncError
    assert str(e.value) == f"receiver `r0` cannot reach version 1: {reason}"
    assert r.statistics().stopped == reason
    r.close()
    wire_loop().run(server.aclose())


def test_a_sender_that_never_answers_the_join_is_named_at_the_timeout():
    async def silent(value, peer):
        await wire_loop().loop.create_future()  # never answers

    quiet = Server(silent, default_address("ipc"))
    address = wire_loop().run(quiet.start())
    with pytest.raises(SenderGone) as e:
        WeightReceiver(group="g", address=address, load=print, name="r0").start(timeout=1)
    assert str(e.value) == (
        f"receiver `r0`: no answer from the sender at {address} within 1 s (is the sender "
        "running, and is this its address?)"
    )
    wire_loop().run(quiet.aclose())


def test_a_receiver_of_an_ipc_path_that_does_not_exist_fails_at_once():
    address = "ipc:///tmp/does-not-exist.sock"
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as e:
        WeightReceiver(group="g", address=address, load=print, name="r0").start()
    assert time.monotonic() - t0 < 5
    assert isinstance(e.value, SenderGone)
    assert str(e.value).startswith(f"receiver `r0` cannot reach the sender at {address}: ")


# -- the sender's ------------------------------------------------------------------------------


def test_a_push_on_a_closed_sender_raises_sender_closed():
    s = WeightSender(group="g", transport="shm")
    s.close()
    with pytest.raises(SenderClosed) as e:
        s.push(weights().items(), version=1)
    assert str(e.value) == (
        "push of version 1: the sender of group 'g' is closed (make a new WeightSender)"
    )


def test_a_push_nobody_joined_waits_its_timeout_and_raises_push_timeout():
    s = WeightSender(group="g", transport="shm")
    t0 = time.monotonic()
    with pytest.raises(PushTimeout) as e:
        s.push(weights().items(), version=1, timeout=0.5)
    assert time.monotonic() - t0 >= 0.5
    assert isinstance(e.value, TimeoutError) and isinstance(e.value, WeightSyncError)
    assert str(e.value) == (
        "push of version 1: 0 of 1 receivers joined group 'g' within 0.5 s (receivers join "
        "with WeightReceiver(..., address=sender.address).start())"
    )
    assert s.statistics().failed_pushes == 1
    s.close()


# -- a rejected push leaves nothing behind -------------------------------------------------------


def wrong_layout():
    sd = weights(1)
    sd["extra"] = torch.zeros(2)
    return sd


def test_after_a_rejected_push_a_generator_of_the_right_layout_commits():
    s = WeightSender(group="g", transport="shm", bucket_bytes=256 << 10)
    engine = Engine(weights())
    r = receiver(s, load=engine.load, expected=engine.params)
    with pytest.raises(WeightSyncError) as e:
        s.push(wrong_layout().items(), version=1, timeout=30)
    assert str(e.value).endswith(
        "rejected the plan: 1 of 5 tensors differ from the receiver's parameters: `extra`: not "
        "a parameter of the receiver, got shape [2] float32; no bucket moved"
    )
    right = weights(2)
    report = s.push(((n, t) for n, t in right.items()), version=2, timeout=30)
    assert report.receivers == ("r0",) and report.tensors == 4 and report.plan_sent
    assert engine.equals(right) and r.version == 2
    r.close()
    s.close()


def test_after_a_rejected_first_push_the_right_tensors_are_still_read_in_place():
    s = WeightSender(group="g", transport="shm", bucket_bytes=256 << 10)
    engine = Engine(weights())
    r = receiver(s, load=engine.load, expected=engine.params)
    with pytest.raises(WeightSyncError):
        s.push(wrong_layout().items(), version=1, timeout=30)
    right = weights(2)
    assert s.push(right.items(), version=2, timeout=30).receivers == ("r0",)
    assert engine.equals(right)
    assert all(t.untyped_storage().is_shared() for t in right.values())  # zero copy: moved
    assert s.statistics().buffer_bytes == 0  # no packing buffers
    r.close()
    s.close()


def test_on_failure_hears_a_failed_push_then_the_end_of_serving():
    heard = []
    done = threading.Event()

    def on_failure(reason, final):
        heard.append((reason, final))
        if final:
            done.set()

    def refuse(items):
        raise ValueError("bucket refused")

    s = WeightSender(group="g", transport="shm")
    r = receiver(s, load=refuse, on_failure=on_failure)
    with pytest.raises(WeightSyncError):
        s.push(weights().items(), version=1, timeout=30)
    want = "load raised ValueError: bucket refused (at bucket 0 of 1, version 1)"
    assert heard[0] == (want, False)
    s.close()
    assert done.wait(10), heard
    reason, final = heard[-1]
    assert final and "went away" in reason
    r.close()


def test_on_failure_must_be_callable():
    s = WeightSender(group="g", transport="shm")
    with pytest.raises(ValueError, match=r"WeightReceiver.on_failure: expected a callable"):
        WeightReceiver(group="g", address=s.address, load=print, on_failure="log")
    s.close()
