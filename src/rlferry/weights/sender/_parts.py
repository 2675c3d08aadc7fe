"""The parts of a sender, fixed for its life: its transport, its hub and control server on
the wire loop, and its counters; made with the sender, closed with it. Every piece of a
push (:class:`~._pusher.Pusher` and the pieces it owns) works with them."""

from __future__ import annotations

from dataclasses import dataclass

from rlferry.wire import Server, default_address, wire_loop

from .._config import SenderConfig
from ..protocol._datagrams import Commits
from ..transports import make_sender
from ..transports._base import CollectiveSender, MailboxSender
from ._course import Course
from ._hub import Hub

__all__ = ["Counts", "SenderParts"]


@dataclass
class Counts:
    """What a sender's pushes did so far (see ``SenderStatistics``)."""

    pushes: int = 0
    failed: int = 0
    bytes: int = 0
    plans: int = 0  # pushes that sent a plan (or buffers, or a group) to a member
    lines: int = 0  # started on the members' start lines
    here: int = 0  # started by the pushing thread alone
    line: int = 0  # ended on the members' words on the commit line
    last_seconds: float = 0.0


class SenderParts:
    """A sender's transport (``mailbox`` or ``collective``: exactly one of them is it; the
    kind decides how a push runs), its :class:`Hub` and the :class:`Course` of its pushes
    there, and the control server at ``address``."""

    def __init__(self, config: SenderConfig) -> None:
        self.config = config
        self.loop = wire_loop()
        self.transport = tr = make_sender(
            config.transport,
            config.bind,
            config.secret,
            nccl_high_priority=config.nccl_high_priority,
        )
        self.mailbox = tr if isinstance(tr, MailboxSender) else None
        self.collective = tr if isinstance(tr, CollectiveSender) else None
        self.hub = hub = self.loop.run(self._make_hub())
        hub.on_leave = tr.receiver_left
        self.course = Course(hub, tr.deadline_passed)
        if self.collective is not None:  # broadcast with a secret: the group meets here
            hub.store = self.collective.kv
        else:
            hub.commits = Commits()
        bind = config.bind or default_address("tcp" if config.transport == "broadcast" else "ipc")
        self.server = Server(hub.handle, bind, secret=config.secret, on_disconnect=hub.disconnected)
        self.address: str = self.loop.run(self.server.start())
        self.counts = Counts()

    async def _make_hub(self) -> Hub:
        return Hub(self.config.group, self.config.transport)

    def close(self) -> None:
        """Stop serving; let the transport and the lines go."""
        self.loop.run(self.server.aclose())
        self.transport.close()
        self.hub.starter.close()
        if self.hub.commits is not None:
            self.hub.commits.close()
