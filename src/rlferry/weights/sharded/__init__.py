"""Many senders to many receivers: every trainer rank sends what it owns, once.

:class:`ShardedSender` (a trainer rank: its links, the cuts of its tensors into each
link's pieces, read once a push: ``_cuts``, ``_ready``) and :class:`ShardedReceiver` (an
engine rank: a receiver a trainer rank it needs bytes from, ``_links``) compute the same
plan from the same layouts (``_plans``). :func:`describe_group` finds every rank from
one address (``_group``: :class:`SenderGroup`); :func:`link_group` names each link.
"""

from ._group import SenderGroup, describe_group
from ._plans import link_group
from ._receiver import ShardedReceiver
from ._sender import ShardedSender

__all__ = ["SenderGroup", "ShardedReceiver", "ShardedSender", "describe_group", "link_group"]
