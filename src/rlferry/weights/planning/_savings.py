"""What sending fewer bytes saves on a cluster: a delta push and a LoRA adapter, predicted.

A **delta push** sends, for each tensor an engine already holds at the base version, only
the elements that changed, in the record :mod:`._delta_layout` sizes (a one-byte place
and the new value a change, an int16 count a block of 256 elements); a tensor where that
would not be at least 10% smaller goes whole, and one that did not change is not sent.
Before it, each trainer rank reads what it pushes and the bytes it kept of the base to
find what changed (at ``diff_GBps`` of pushed bytes a second). The links, buckets and
fixed costs are :func:`predict`'s, on the encoded bytes.

A **LoRA push** sends an adapter instead of the model: for every linear weight of the
attention and the MLP (``out x in``), ``A`` (``rank x in``) and ``B`` (``out x rank``),
laid out and sent as any tensors are.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlferry.errors import RequestError

from ._delta_layout import sent_bytes
from ._predict import Cluster, Prediction, predict
from ._specs import TensorSpec

__all__ = [
    "DIFF_GBPS",
    "DeltaPrediction",
    "delta_bytes",
    "lora_specs",
    "predict_delta",
]

# The rate a trainer GPU finds what changed, in bytes pushed a second (it reads them and the
# base, and writes the changes into the record and the base): Qwen3-8B's 16.4 GB bf16 at 1%
# changed in 45.9 ms on an H200 (`python benchmarks/delta_diff.py --device cuda`).
DIFF_GBPS = 350.0
# The linear layers a LoRA adapter covers: every one of the attention and of the MLP
# (experts included), as PEFT's "all-linear" does, the output head excluded.
_LINEAR = re.compile(r"(self_attn|mlp|attention|block_sparse_moe)\..*\.weight$")


def delta_bytes(elements: int, dtype: torch.dtype, changed: float) -> int:
    """The bytes a delta of ``elements`` elements of ``dtype`` takes when ``changed`` of
    them (a fraction) changed."""
    return sent_bytes(elements, math.ceil(changed * elements), dtype.itemsize)


@dataclass(frozen=True)
class DeltaPrediction:
    """A delta push beside the full push of the same update."""

    changed: float
    full: Prediction
    delta: Prediction
    diff_seconds: float  # the busiest trainer rank's diff

    @property
    def seconds(self) -> float:
        return self.diff_seconds + self.delta.seconds

    def text(self) -> str:
        f, d = self.full, self.delta
        return (
            f"delta push, {self.changed:.2%} of the elements changed: sent "
            f"{d.sent_bytes / 1e9:.3f} GB ({d.sent_bytes / f.sent_bytes:.1%} of the full "
            f"push's {f.sent_bytes / 1e9:.2f} GB); predicted {self.seconds * 1e3:.1f} ms: the "
            f"diff {self.diff_seconds * 1e3:.1f} ms on the busiest trainer rank, the busiest "
            f"link {d.link_seconds * 1e3:.1f} ms, {d.fixed_seconds * 1e3:.1f} ms for the "
            f"links, {d.bucket_seconds * 1e3:.1f} ms for the buckets; the full push "
            f"{f.seconds * 1e3:.1f} ms, {f.seconds / self.seconds:.1f}x"
        )


def predict_delta(
    specs: Sequence[TensorSpec], cluster: Cluster, changed: float, diff_GBps: float = DIFF_GBPS
) -> DeltaPrediction:
    """A delta push of ``specs`` on ``cluster`` where ``changed`` of the elements changed
    since the base, beside the full push."""
    if not 0 <= changed <= 1:
        raise RequestError(f"changed: expected a fraction in [0, 1], got {changed!r}")
    if not diff_GBps > 0:
        raise RequestError(f"diff_GBps: expected a rate > 0, got {diff_GBps!r}")
    full = predict(specs, cluster)
    delta = predict(specs, cluster, encoded=lambda n, dtype: delta_bytes(n, dtype, changed))
    diff = max(full.sender_bytes) / (diff_GBps * 1e9)
    return DeltaPrediction(changed, full, delta, diff)


def lora_specs(specs: Sequence[TensorSpec], rank: int, dtype: torch.dtype) -> list[TensorSpec]:
    """A rank-``rank`` adapter's tensors for the linear weights of ``specs``, named as PEFT
    saves them (``base_model.model.<module>.lora_A.weight``)."""
    if type(rank) is not int or rank < 1:
        raise RequestError(f"lora rank: expected an int >= 1, got {rank!r}")
    out = []
    for s in specs:
        if len(s.shape) != 2 or not _LINEAR.search(s.name):
            continue
        module = f"base_model.model.{s.name.removesuffix('.weight')}"
        rows, cols = s.shape
        out.append(TensorSpec(f"{module}.lora_A.weight", (rank, cols), dtype))
        out.append(TensorSpec(f"{module}.lora_B.weight", (rows, rank), dtype))
    if not out:
        raise RequestError(
            "lora rank: the model has no linear weight of its attention or MLP to adapt"
        )
    return out
