"""What a rank's links take: bucket buffers within a budget, NCCL's thread blocks and its
device memory (the sender sizes its links by these; ``rlferry plan-weights`` prints them)."""

from __future__ import annotations

from ._shard_plan import ShardPlan

__all__ = [
    "LINK_BUFFER_BYTES",
    "MIN_BUCKET_BYTES",
    "bucket_cap",
    "busier_ends",
    "link_ctas",
    "link_nccl_bytes",
]

# What a rank's link buffers may take together by default (every link has two bucket
# buffers at each end): 4 GiB keeps up to 8 links a rank at the single sender's 256 MiB
# buckets (every run measured); a rank with more links gets smaller buckets, in steps of
# MIN_BUCKET_BYTES (the size shm rounds its buffers to) and never below it. Unbounded, an
# engine rank hearing from 256 trainer ranks would hold two buffers of up to 256 MiB for
# each (``rlferry plan-weights kimi-k2 --trainer-gpus 256 --engines 8 --engine-tp 16``).
LINK_BUFFER_BYTES = 4 << 30
MIN_BUCKET_BYTES = 2 << 20
# NCCL's device memory for point-to-point links (H100s, torch 2.11's NCCL), measured by
# ``python benchmarks/nccl_links.py`` and by the ranks' own count in ``python
# benchmarks/weights_sharded.py --device cuda --transport broadcast --point-to-point``:
# about 400 MiB once a
# process, 260 MiB a link's two-rank group at NCCL's own choice of thread blocks (CTAs) or
# 9 MiB a block when capped, and 160-224 MiB for each other GPU of the host a rank
# reaches. Up to FREE_LINKS links a rank keep NCCL's choice; more share LINK_CTAS blocks,
# never under MIN_LINK_CTAS (see link_ctas).
NCCL_PROCESS_BYTES, NCCL_PEER_BYTES = 400 << 20, 224 << 20
NCCL_LINK_BYTES, NCCL_CTA_BYTES = 260 << 20, 9 << 20
FREE_LINKS, LINK_CTAS, MIN_LINK_CTAS = 8, 32, 2


def bucket_cap(budget: int, links: int) -> int:
    """The largest bucket of a link whose busier end has ``links`` links: their two buffers
    each fit ``budget`` together (never below ``MIN_BUCKET_BYTES``: more buckets cost
    time, see ``rlferry plan-weights``)."""
    step = MIN_BUCKET_BYTES
    return max(step, budget // (2 * max(1, links)) // step * step)


def link_ctas(links: int) -> int:
    """NCCL thread blocks for a point-to-point link whose busier end has ``links`` links
    (0: NCCL's own choice). Up to FREE_LINKS links keep NCCL's choice: capped at 16 blocks,
    a 16.4 GB update takes 7-9% longer (one and two links a rank, ``python
    benchmarks/weights_sharded.py --device cuda --transport broadcast --point-to-point
    --scale 1`` on four H100s). More links share LINK_CTAS blocks, at least MIN_LINK_CTAS a
    link, which bounds NCCL's memory (an engine rank hearing from 256 trainer ranks would
    take 70 GB for their groups at NCCL's choice, 4.8 GB so); sixteen links of 2 blocks
    between two H100s move 2 GiB at 355-365 GB/s, as two of NCCL's choice do (367-372;
    ``python benchmarks/nccl_links.py``)."""
    if links <= FREE_LINKS:
        return 0
    return max(MIN_LINK_CTAS, LINK_CTAS // links)


def link_nccl_bytes(links: int) -> int:
    """About what NCCL allocates on each end for a link's group (see :func:`link_ctas`;
    besides NCCL_PROCESS_BYTES once a process and NCCL_PEER_BYTES a GPU reached)."""
    ctas = link_ctas(links)
    return ctas * NCCL_CTA_BYTES if ctas else NCCL_LINK_BYTES


def busier_ends(plan: ShardPlan, rank: int, point_to_point: bool) -> dict[int, int]:
    """For each of trainer rank ``rank``'s links (by engine rank; -1: its shared stream),
    the links of whichever end has more (an engine rank hears from every trainer rank it
    needs bytes from): what the link's buffers and NCCL blocks are shared by."""
    receivers = plan.receivers_of(rank)
    if point_to_point:
        return {r: max(len(receivers), len(plan.senders_of(r))) for r in receivers}
    return {-1: max((len(plan.senders_of(r)) for r in receivers), default=1)}
