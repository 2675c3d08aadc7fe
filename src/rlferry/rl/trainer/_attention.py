"""Attention over short rows as plain matrix products, for a compiled training step.

A GRPO step of the demo's task attends over rows of a dozen tokens. SDPA's fused kernels
tile for long rows: on an H200, cuDNN's flash attention took 7.4 ms forward and 11.8 ms
backward of a 62 ms Qwen3-0.6B step at 512 rows of 12 tokens, most of each tile padding.
Written as two batched products and a softmax, inside a layer ``torch.compile`` compiles,
the softmax, the mask and the casts fuse into one kernel between the products.
:data:`SHORT` is the longest row that takes this path (``benchmarks/_attention_tune.py``
measures both paths per width); longer rows keep transformers' SDPA, whose memory does not
grow with the square of the row.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SHORT", "SHORT_ATTENTION", "short_attention", "use_short_attention"]

SHORT = 128
"""The longest row (tokens) that attends through :func:`short_attention`."""

SHORT_ATTENTION = "rlferry_short_attention"
"""The name :func:`use_short_attention` registers :func:`short_attention` under."""


def short_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention interface: ``query`` ``(b, heads, L, d)``, ``key`` and
    ``value`` ``(b, kv_heads, S, d)``, ``attention_mask`` a boolean ``(b or 1, 1, L, S)``
    (True: attend); returns ``(b, L, heads, d)``. Query heads read their key-value head
    in groups (no copy of the keys per query head). A sliding window, an additive mask or
    rows longer than :data:`SHORT` go to transformers' SDPA."""
    b, heads, length, dim = query.shape
    kv, span = key.shape[1], key.shape[2]
    if (
        kwargs.get("sliding_window") is not None
        or (attention_mask is not None and attention_mask.dtype != torch.bool)
        or span > SHORT
    ):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)  # fmt: skip
    groups = heads // kv
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(b, kv, groups * length, dim)  # a KV head's query heads, row after row
    scores = torch.matmul(q, key.transpose(-1, -2)).view(b, kv, groups, length, span)
    scores = scores.float() * scale
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    if dropout and module.training:
        weights = torch.nn.functional.dropout(weights, p=dropout)
    out = torch.matmul(weights.view(b, kv, groups * length, span), value)
    return out.view(b, heads, length, dim).transpose(1, 2), None


def use_short_attention(model: Any) -> None:
    """Have ``model`` attend through :func:`short_attention` (registered with transformers
    once; its masks made as for SDPA: boolean)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SHORT_ATTENTION, short_attention)
    AttentionMaskInterface.register(SHORT_ATTENTION, sdpa_mask)
    model.set_attn_implementation(SHORT_ATTENTION)
