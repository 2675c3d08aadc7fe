"""Faster kernels for the transformers models an :class:`~rlferry.engines.hf.HFEngine`
serves with its slot cache: the same values in fewer GPU kernels, set on the model (or,
for the rotary embedding, on its transformers module) when the engine is made."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GQA_SDPA", "fuse_mlps", "fuse_rms_norms", "fuse_rotary", "use_gqa_sdpa"]

GQA_SDPA = "rlferry_gqa_sdpa"
"""transformers' SDPA attention, but a one-token step of a grouped-query model reads the
cache as it is: through cuDNN's grouped-query attention where it runs (see
:data:`_CUDNN_GQA`), else with its query heads viewed as groups of the KV heads (measured
on an H100, Qwen3-0.6B shapes at 64 rows: transformers' SDPA copied the whole cache to
repeat each KV head, 3.2 of a decode step's 9.3 ms of GPU time)."""


def _gqa_sdpa(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    if length != 1 or groups == 1 or attention_mask is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if (query.device, query.dtype) in _CUDNN_GQA:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
            )
        return out.transpose(1, 2), None
    # Query head h reads KV head h // groups (transformers' repeat_kv): (b, kv, groups, dim).
    q = query.reshape(b, key.shape[1], groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(b, 1, heads, dim), None


_CUDNN_GQA: set[tuple[torch.device, torch.dtype]] = set()
"""Where a one-token step attends through cuDNN's grouped-query attention with a mask
(measured on an H100 at 256 rows of 256 columns, Qwen3-0.6B shapes: 115 us a layer,
against 147 us for the query heads viewed as groups of the KV heads)."""


def _probe_cudnn_gqa(device: torch.device, dtype: torch.dtype) -> None:
    """Add ``(device, dtype)`` to :data:`_CUDNN_GQA` if cuDNN runs such an attention there."""
    import warnings

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return
    q = torch.zeros((2, 4, 1, 64), device=device, dtype=dtype)
    kv = torch.zeros((2, 2, 16, 64), device=device, dtype=dtype)
    mask = torch.zeros((2, 1, 1, 16), device=device, dtype=dtype)
    with warnings.catch_warnings(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        warnings.simplefilter("ignore")  # torch says why no kernel fits: the answer is no
        try:
            torch.nn.functional.scaled_dot_product_attention(
                q, kv, kv, attn_mask=mask, enable_gqa=True
            )
        except RuntimeError:  # "No available kernel": keep the view of the query heads
            return
    _CUDNN_GQA.add((device, dtype))


def use_gqa_sdpa(model: Any) -> None:
    """Have ``model`` attend through :data:`GQA_SDPA` (registered with transformers once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, _gqa_sdpa)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)
    first = next(model.parameters(), None)
    if first is not None:
        _probe_cudnn_gqa(first.device, first.dtype)


_RMS_NORMS = frozenset(f"{m}RMSNorm" for m in (
    "Llama", "Mistral", "Mixtral", "Qwen2", "Qwen2Moe", "Qwen3", "Qwen3Moe",
))  # fmt: skip
"""transformers' RMSNorm classes that compute ``weight * (x32 * rsqrt(mean(x32^2) + eps))
.to(x.dtype)``, ``eps`` as ``variance_epsilon``."""


def _rms_norm(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The same computation as those classes, in 4 kernels instead of 8."""
    x = torch.nn.functional.rms_norm(
        hidden_states.float(), (hidden_states.shape[-1],), eps=self.variance_epsilon
    )
    return self.weight * x.to(hidden_states.dtype)


def _rms_values(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Those classes' computation, as a function to compile."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_norm_compiled(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The same computation in one kernel."""
    x = hidden_states.reshape(-1, hidden_states.shape[-1])  # see _compiled
    return _compiled(_rms_values)(x, self.weight, self.variance_epsilon).view(hidden_states.shape)


_COMPILED: dict[Any, Any] = {}


def _compiled(fn: Any) -> Any:
    """``fn`` compiled once for the process by ``torch.compile`` (Triton kernels), rounding
    where its eager operators round. Shapes are dynamic: every rows bucket and width of a
    slot cache share a compilation, made at its first call (the slot cache's warm-up runs
    make them before any graph is captured). Its callers give it 2-D tensors where they
    can: a dimension of 1 gets a compilation of its own, and past dynamo's recompile limit
    (8 a function) a call runs ``fn`` as it is (the same values, more kernels)."""
    out = _COMPILED.get(fn)
    if out is None:
        out = _COMPILED[fn] = torch.compile(
            fn, dynamic=True, options={"emulate_precision_casts": True}
        )
    return out


def fuse_rms_norms(model: Any, *, compiled: bool = False) -> int:
    """Have every RMSNorm layer of ``model`` of a class in :data:`_RMS_NORMS` compute the
    same values in fewer kernels (a decode step of Qwen3-0.6B shapes runs 4 norms a layer,
    each 8 small kernels in transformers' own): through ``torch.nn.functional.rms_norm``
    (4 kernels), or ``compiled`` (CUDA: one); the layers changed."""
    forward = _rms_norm_compiled if compiled else _rms_norm
    n = 0
    for module in model.modules():
        if type(module).__name__ in _RMS_NORMS and isinstance(
            getattr(module, "variance_epsilon", None), float
        ):
            module.forward = forward.__get__(module)
            n += 1
    return n


_MLPS = frozenset(f"{m}MLP" for m in ("Llama", "Mistral", "Qwen2", "Qwen3"))
"""transformers' MLP classes that compute ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def _mlp(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The same computation, the activation and the product in one compiled kernel."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    rows = (-1, gate.shape[-1])  # see _compiled
    both = _compiled(_silu_mul)(gate.reshape(rows), up.reshape(rows))
    return self.down_proj(both.view(gate.shape))


def fuse_mlps(model: Any) -> int:
    """Have every MLP of ``model`` of a class in :data:`_MLPS` whose activation is SiLU
    compute ``silu(gate) * up`` in one compiled kernel (CUDA: Triton) instead of two; the
    MLPs changed."""
    n = 0
    for module in model.modules():
        act = getattr(module, "act_fn", None)
        if type(module).__name__ in _MLPS and type(act).__name__ in ("SiLU", "SiLUActivation"):
            module.forward = _mlp.__get__(module)
            n += 1
    return n


_ROTARY_MODULES = frozenset(f"transformers.models.{m}.modeling_{m}" for m in (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
))  # fmt: skip
"""transformers' modeling modules whose ``apply_rotary_pos_emb(q, k, cos, sin)`` computes
``x * cos + rotate_half(x) * sin`` for q and k, ``rotate_half(x) = cat(-x2, x1)``."""


def _rotary(original: Any) -> Any:
    def apply_rotary_pos_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        unsqueeze_dim: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The same values as transformers', for q and k together: 6 kernels, not 10."""
        if unsqueeze_dim != 1 or q.dim() != 4 or q.shape[::2] != k.shape[::2]:
            return original(q, k, cos, sin, unsqueeze_dim)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        qk = torch.cat((q, k), dim=1)
        half = qk.shape[-1] // 2
        out = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
        return out[:, : q.shape[1]], out[:, q.shape[1] :]

    apply_rotary_pos_emb.rlferry_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def fuse_rotary(model: Any) -> bool:
    """Have the rotary embedding of ``model``'s family (a module of :data:`_ROTARY_MODULES`)
    rotate q and k together: the same values, 4 kernels fewer a layer. It changes that
    transformers module for the process (its every model computes the same values).
    Not compiled: with dynamic shapes inductor's one kernel took 40 us a layer on an H200,
    against ~15 for these six."""
    import sys

    for cls in type(model).__mro__:
        name = cls.__module__
        module = sys.modules.get(name)
        if name not in _ROTARY_MODULES or module is None:
            continue
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if fn is None:
            return False
        if not hasattr(fn, "rlferry_original"):
            module.apply_rotary_pos_emb = _rotary(fn)  # type: ignore[attr-defined]
        return True
    return False
