"""The transport interface: what the sender and the receiver use, named and typed."""

import inspect
import pathlib

import pytest

from rlferry.weights.transports import make_receiver, make_sender
from rlferry.weights.transports._base import (
    CollectiveReceiver,
    CollectiveSender,
    MailboxReceiver,
    MailboxSender,
)

KINDS = {"shm": "mailbox", "cuda_ipc": "mailbox", "broadcast": "collective"}


@pytest.mark.parametrize("name", list(KINDS))
def test_each_transport_is_a_mailbox_or_a_collective_with_its_whole_interface(name):
    sender, receiver = make_sender(name, None, None), make_receiver(name)
    mailbox = KINDS[name] == "mailbox"
    assert isinstance(sender, MailboxSender if mailbox else CollectiveSender)
    assert isinstance(receiver, MailboxReceiver if mailbox else CollectiveReceiver)
    assert sender.collective is not mailbox
    assert not inspect.isabstract(type(sender)) and not inspect.isabstract(type(receiver))
    sender.close()
    receiver.close()


def test_the_sender_and_receiver_never_probe_a_transport_by_attribute_name():
    src = pathlib.Path(__file__).parents[1] / "src" / "rlferry" / "weights"
    for name in (
        "sender/_sender.py",
        "sender/_pusher.py",
        "sender/_preparing.py",
        "sender/_launching.py",
        "sender/_finishing.py",
        "receiver/_receiver.py",
        "receiver/_connection.py",
        "receiver/_loading.py",
    ):
        text = (src / name).read_text()
        for probe in ("hasattr(", "getattr(", "type: ignore"):
            assert probe not in text, f"{name} uses {probe}"
