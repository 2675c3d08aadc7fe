"""Who a push goes to: receivers that are ready, never a peer that joined and went quiet."""

import asyncio
import os
import socket
import threading
import time

import pytest
import torch

from rlferry.weights import PushTimeout, WeightReceiver, WeightSender
from rlferry.weights._hub import Hub, Push
from rlferry.weights._messages import (
    ABORTED,
    IDLE,
    Abort,
    Ack,
    Join,
    Leave,
    Noted,
    Stream,
    Watch,
    decode_reply,
    encode,
)
from rlferry.wire import Client

HOST = socket.gethostname()
WHERE = f"pid {os.getpid()} on {HOST}"
HINT = (
    "(a peer that sent Join and nothing since, or a receiver whose thread is stuck or "
    "whose process is stopped)"
)


def weights():
    return {"w": torch.arange(4, dtype=torch.float32), "b": torch.ones(3)}


class Engine:
    def __init__(self, gate=None):
        self.params = {n: torch.zeros_like(t) for n, t in weights().items()}
        self.gate = gate

    def load(self, items):
        if self.gate is not None:
            self.gate.wait()
        for n, t in items:
            self.params[n].copy_(t)


def receiver(sender, name, engine=None):
    engine = engine or Engine()
    return WeightReceiver(group="g", address=sender.address, load=engine.load, name=name).start()


def ghost(sender):
    """A peer that joins the group and then sends nothing (its connection stays open)."""
    c = Client(sender.address)
    c.request(encode(Join("g", "", "ghost", "elsewhere", 4242)), timeout=10)
    return c


def test_the_first_push_names_a_peer_that_joined_but_never_asked_for_work():
    s = WeightSender(group="g", transport="shm", receivers=2)
    r0 = receiver(s, "r0")
    g = ghost(s)
    t0 = time.monotonic()
    with pytest.raises(PushTimeout) as e:
        s.push(weights().items(), version=1, timeout=1)
    assert 1 <= time.monotonic() - t0 < 5  # waited its timeout, as the first push does
    assert str(e.value) == (
        "push of version 1: 1 of 2 receivers ready in group 'g' within 1 s: receiver `ghost` "
        f"(pid 4242 on elsewhere) joined but never asked for work {HINT}"
    )
    assert isinstance(e.value, TimeoutError)
    g.close()
    r0.close()
    s.close()


def test_a_peer_that_joined_and_went_quiet_does_not_hold_up_later_pushes():
    s = WeightSender(group="g", transport="shm", receivers=1)
    engine = Engine()
    r0 = receiver(s, "r0", engine)
    s.push(weights().items(), version=1, timeout=30)
    g = ghost(s)
    t0 = time.monotonic()
    report = s.push(weights().items(), version=2, timeout=10)  # waits a short grace at most
    assert report.receivers == ("r0",) and time.monotonic() - t0 < 5
    t0 = time.monotonic()
    report = s.push(weights().items(), version=3, timeout=10)  # and no longer once it ran out
    assert report.receivers == ("r0",) and time.monotonic() - t0 < 1
    assert r0.version == 3 and torch.equal(engine.params["w"], weights()["w"])
    g.close()
    r0.close()
    s.close()


@pytest.mark.slow
def test_a_later_push_with_only_a_quiet_peer_names_it_at_the_timeout():
    s = WeightSender(group="g", transport="shm", receivers=1)
    r0 = receiver(s, "r0")
    s.push(weights().items(), version=1, timeout=30)
    r0.close()
    g = ghost(s)
    with pytest.raises(PushTimeout) as e:
        s.push(weights().items(), version=2, timeout=3)
    assert str(e.value) == (
        "push of version 2: 0 of 1 receivers ready in group 'g' within 3 s: receiver `ghost` "
        f"(pid 4242 on elsewhere) joined but never asked for work {HINT}"
    )
    g.close()
    s.close()


def test_a_receiver_stuck_in_its_load_is_named_and_serves_again_once_it_returns():
    s = WeightSender(group="g", transport="shm", receivers=1)
    gate = threading.Event()
    stuck = Engine(gate)
    r0 = receiver(s, "r0", stuck)
    with pytest.raises(PushTimeout) as e:
        s.push(weights().items(), version=1, timeout=1)
    assert str(e.value) == (
        f"push of version 1: receiver `r0` ({WHERE}): did not finish within the push's "
        "timeout; none committed it"
    )
    assert e.value.failures == {"r0": "did not finish within the push's timeout"}
    with pytest.raises(PushTimeout) as e:
        s.push(weights().items(), version=2, timeout=1)
    assert str(e.value) == (
        f"push of version 2: 0 of 1 receivers ready in group 'g' within 1 s: receiver `r0` "
        f"({WHERE}) took part in the push of version 1 and has not asked for work since "
        "(a `load` or `on_commit` that does not return, or a stopped process)"
    )
    gate.set()  # the load returns: the receiver asks for work again
    report = s.push(weights().items(), version=3, timeout=30)
    assert report.receivers == ("r0",) and r0.version == 3
    r0.close()
    s.close()


def test_the_first_push_with_too_few_receivers_says_how_many_joined():
    s = WeightSender(group="g", transport="shm", receivers=2)
    r0 = receiver(s, "r0")
    with pytest.raises(PushTimeout) as e:
        s.push(weights().items(), version=1, timeout=0.5)
    assert str(e.value) == (
        "push of version 1: 1 of 2 receivers joined group 'g' within 0.5 s (receivers join "
        "with WeightReceiver(..., address=sender.address).start())"
    )
    r0.close()
    s.close()


def test_a_watch_is_answered_once_when_its_receivers_push_is_aborted_and_when_it_leaves():
    """A receiver of an NCCL group waits on the device, deaf to its socket: the Watch it
    keeps parked at the sender's hub is what ends that wait when its push is aborted
    (``weights/_watch``; on GPUs, tests/test_weights_gpu.py kills processes mid-push)."""

    async def run():
        hub = Hub("g", "broadcast")
        welcome = decode_reply(await hub.handle(encode(Join("g", "", "r", HOST, 1)), b"r"))
        assert welcome.key == b"r"
        unknown = decode_reply(await hub.handle(encode(Watch(b"nobody")), b"w"))
        assert unknown == Noted()
        ask = asyncio.ensure_future(hub.handle(encode(Ack(0, IDLE)), b"r"))
        deadline = time.monotonic() + 5
        args = {"seq": 1, "version": 7, "timeout": 5}
        members, _ = await hub.begin(args, 1, deadline)
        await hub.start(Push(1, 7, None, "fp", members, {}, True, False), streaming=True)
        assert decode_reply(await ask) == Stream(1, 7)
        watch = asyncio.ensure_future(hub.handle(encode(Watch(b"r")), b"w"))
        aborting = asyncio.ensure_future(hub.abort("the trainer failed", deadline))
        assert decode_reply(await asyncio.wait_for(watch, 5)) == Abort(1, "the trainer failed", 7)
        again = asyncio.ensure_future(hub.handle(encode(Watch(b"r", seen=1)), b"w"))
        await hub.handle(encode(Ack(1, ABORTED, park=False)), b"r")
        await asyncio.wait_for(aborting, 5)
        hub.done()
        assert not again.done()  # told of push 1 once: it waits for a later one
        await hub.handle(encode(Leave()), b"r")
        assert decode_reply(await asyncio.wait_for(again, 5)) == Noted()

    asyncio.run(run())
