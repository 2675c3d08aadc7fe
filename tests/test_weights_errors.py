"""How a sender and a receiver end: closed, gone, timed out, failed; and what a failed push
leaves behind (nothing)."""

import pytest
import torch

from rlferry.weights import WeightReceiver, WeightSender, WeightSyncError


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
