"""TransferQueue's samplers: which ready samples a ``get_meta`` returns.

A sampler is called as ``sampler(ready_indexes, batch_size, partition=..., **sampling_config)``
and returns ``(sampled, consumed)``; the controller marks ``consumed`` as read by the task.
"""

from ._balanced import SeqlenBalancedSampler, get_seqlen_balanced_partitions
from ._base import BaseSampler, SequentialSampler
from ._grpo import GRPOGroupNSampler
from ._rank_aware import RankAwareSampler

__all__ = [
    "BaseSampler",
    "GRPOGroupNSampler",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "get_seqlen_balanced_partitions",
]
