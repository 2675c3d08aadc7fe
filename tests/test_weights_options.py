"""The sender's options for comparisons (per-tensor packs, NCCL stream priority): validated
constructor options, no module switches."""

import pytest
import torch

from rlferry.weights import WeightReceiver, WeightSender
from rlferry.weights.copies import _pack
from rlferry.weights.transports import _distributed_sender


def test_sender_rejects_a_grouped_pack_that_is_not_a_bool():
    with pytest.raises(ValueError) as e:
        WeightSender(group="g", grouped_pack="yes")
    assert str(e.value) == "WeightSender.grouped_pack: expected a bool, got 'yes'"


def test_sender_rejects_an_nccl_high_priority_that_is_not_a_bool():
    with pytest.raises(ValueError) as e:
        WeightSender(group="g", transport="broadcast", nccl_high_priority=1)
    assert str(e.value) == "WeightSender.nccl_high_priority: expected a bool, got 1"


def test_no_module_switch_is_left():
    assert not hasattr(_pack, "GROUPED_PACK") and not hasattr(_distributed_sender, "HIGH_PRIORITY")


@pytest.mark.parametrize("grouped", [True, False])
def test_grouped_pack_off_packs_per_tensor_and_delivers_the_same_values(grouped):
    s = WeightSender(group="g", transport="shm", zero_copy=False, grouped_pack=grouped,
                     bucket_bytes=256 << 10)  # fmt: skip
    sd = {f"w{i}": torch.randn(128, 256) for i in range(4)}
    params = {n: torch.zeros_like(t) for n, t in sd.items()}

    def load(items):
        for n, t in items:
            params[n].copy_(t)

    r = WeightReceiver(group="g", address=s.address, load=load).start()
    for v in (1, 2, 3):
        for t in sd.values():
            t.add_(1)
        s.push(sd.items(), version=v, timeout=30)
        assert all(torch.equal(params[n], t) for n, t in sd.items())
    built = [c is not None for c in s._pusher.preparer.packer._copies]
    assert built == [grouped] * len(built)  # grouped: built on the second push, then reused
    r.close()
    s.close()


@pytest.mark.parametrize("high", [True, False])
def test_the_group_descriptor_carries_the_senders_nccl_priority(high):
    s = WeightSender(group="g", transport="broadcast", nccl_high_priority=high)
    desc = s._pusher.parts.transport.group_for([b"a"], 10.0, torch.device("cuda", 0))
    assert desc[b"a"]["backend"] == "nccl" and desc[b"a"]["high_priority"] is high
    assert desc[b"a"]["max_ctas"] == 0  # NCCL's own choice unless a ShardedSender caps it
    s._pusher.cap_ctas(6)
    desc = s._pusher.parts.transport.group_for([b"b"], 10.0, torch.device("cuda", 0))
    assert desc[b"b"]["max_ctas"] == 6
    s.close()
