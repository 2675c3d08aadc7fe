"""Who a push goes to: receivers that are ready, never a peer that joined and went quiet."""

import os
import socket
import threading
import time

import pytest
import torch

from rlferry.weights import PushTimeout, WeightReceiver, WeightSender
from rlferry.weights._messages import Join, encode
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
