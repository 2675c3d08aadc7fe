"""``rlferry plan-weights``: a ``transformers`` model and a cluster, planned and timed.

The model's tensors come from a ``transformers`` configuration built on the meta
device (nothing downloaded, no memory): a ``config.json``, a configuration class
with sizes given as ``key=value``, or a preset of published sizes. The prediction is
:func:`predict`'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlferry.errors import RequestError

from ._blocks import BLOCK_FP8
from ._budget import LINK_BUFFER_BYTES, MIN_BUCKET_BYTES
from ._predict import BUCKET_MS, LINK_MS, QUANTIZE_GBPS, UPDATE_MS, Cluster, predict
from ._savings import DIFF_GBPS, lora_specs, predict_delta
from ._specs import TensorSpec

__all__ = ["PRESETS", "model_specs", "parse_overrides", "plan_weights", "preset_or_config"]


def model_specs(
    config: str, overrides: Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16
) -> list[TensorSpec]:
    """The state dict's names and shapes of a ``transformers`` causal LM, in ``dtype``.

    ``config``: a ``config.json`` path, or a configuration class name of ``transformers``
    (``Qwen3MoeConfig``) built with ``overrides``. Needs the ``hf`` extra.
    """
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "plan-weights needs transformers to build the model: pip install 'rlferry[hf]'"
        ) from None
    overrides = dict(overrides or {})
    if config.endswith(".json"):
        with open(config) as f:
            values = json.load(f)
        model_type = values.pop("model_type", None)
        if not model_type:
            raise RequestError(f"config {config!r}: expected a `model_type` key, got none")
        cfg = transformers.AutoConfig.for_model(model_type, **{**values, **overrides})
    else:
        cls = getattr(transformers, config, None)
        if not isinstance(cls, type) or not issubclass(cls, transformers.PretrainedConfig):
            raise RequestError(
                f"config: expected a config.json path, a transformers configuration class "
                f"name such as Qwen3MoeConfig or a preset ({', '.join(PRESETS)}), got {config!r}"
            )
        cfg = cls(**overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return [TensorSpec(n, tuple(t.shape), dtype) for n, t in model.state_dict().items()]


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``key=value`` pairs; a value is read as JSON when it parses (numbers, lists,
    true/false/null), else kept as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise RequestError(f"--set: expected key=value, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen3-235B-A22B's published config.json sizes
    "qwen3-235b-a22b": ("Qwen3MoeConfig", {
        "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
        "vocab_size": 151936, "tie_word_embeddings": False,
    }),
    # Kimi-K2 (1T, 32B active): DeepSeek-V3's architecture with Kimi-K2's published sizes
    "kimi-k2": ("DeepseekV3Config", {
        "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64,
        "num_key_value_heads": 64, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 163840, "tie_word_embeddings": False,
    }),
}  # fmt: skip


def preset_or_config(config: str, overrides: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A preset's configuration class and sizes (``overrides`` on top), or ``config`` as given."""
    if config in PRESETS:
        cls, sizes = PRESETS[config]
        return cls, {**sizes, **overrides}
    return config, dict(overrides)


def _dtype(field: str, name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RequestError(
            f"{field}: expected a torch dtype name such as bfloat16 or float8_e4m3fn, got {name!r}"
        )
    return dtype


def _engine_dtype(name: str) -> torch.dtype | str:
    """``--engine-dtype``: a torch dtype's name, or ``fp8_block128`` (block FP8)."""
    if name == BLOCK_FP8:
        return name
    try:
        return _dtype("--engine-dtype", name)
    except RequestError:
        raise RequestError(
            f"--engine-dtype: expected a torch dtype name such as bfloat16 or float8_e4m3fn, "
            f"or {BLOCK_FP8} (block FP8), got {name!r}"
        ) from None


def plan_weights(
    config: str,
    overrides: Sequence[str] = (),
    *,
    trainer_gpus: int,
    trainer_tp: int = 1,
    trainer_dtype: str = "bfloat16",
    engines: int,
    engine_tp: int,
    engine_dtype: str = "float8_e4m3fn",
    gpus_per_host: int = 8,
    nvlink_gbytes: float = 450.0,
    network_gbits: float = 400.0,
    update_ms: float = UPDATE_MS,
    link_ms: float = LINK_MS,
    bucket_ms: float = BUCKET_MS,
    buffer_gib: float = LINK_BUFFER_BYTES / 2**30,
    quantize_gbytes: float = QUANTIZE_GBPS,
    changed: float | None = None,
    diff_gbytes: float = DIFF_GBPS,
    lora_rank: int | None = None,
) -> str:
    """``rlferry plan-weights``: the prediction for a model and a cluster, as text; with
    ``changed`` (a fraction of the elements) a delta push's beside it, with ``lora_rank``
    a LoRA adapter's (in the trainer's dtype)."""
    if type(trainer_tp) is not int or trainer_tp < 1 or trainer_gpus % trainer_tp:
        raise RequestError(
            f"--trainer-tp: expected a divisor of --trainer-gpus {trainer_gpus}, got {trainer_tp!r}"
        )
    if not buffer_gib * 2**30 >= 2 * MIN_BUCKET_BYTES:
        raise RequestError(
            f"--buffer-gib: expected at least {2 * MIN_BUCKET_BYTES / 2**30:g} (two buffers of "
            f"the smallest bucket, {MIN_BUCKET_BYTES >> 20} MiB), got {buffer_gib!r}"
        )
    cls, values = preset_or_config(config, parse_overrides(overrides))
    specs = model_specs(cls, values, _dtype("--trainer-dtype", trainer_dtype))
    cluster = Cluster(
        fsdp=trainer_gpus // trainer_tp, trainer_tp=trainer_tp, engines=engines,
        engine_tp=engine_tp, engine_dtype=_engine_dtype(engine_dtype),
        gpus_per_host=gpus_per_host, nvlink_GBps=nvlink_gbytes, network_GBps=network_gbits / 8,
        update_ms=update_ms, link_ms=link_ms, bucket_ms=bucket_ms,
        buffer_bytes=int(buffer_gib * 2**30) // 256 * 256, quantize_GBps=quantize_gbytes,
    )  # fmt: skip
    lines = [predict(specs, cluster).text()]
    if changed is not None:
        lines.append(predict_delta(specs, cluster, changed, diff_gbytes).text())
    if lora_rank is not None:
        trainer = _dtype("--trainer-dtype", trainer_dtype)
        adapter = lora_specs(specs, lora_rank, trainer)
        p = predict(adapter, dataclasses.replace(cluster, engine_dtype=trainer))
        model = sum(s.nbytes for s in specs)
        lines.append(
            f"LoRA rank {lora_rank} (every linear of the attention and the MLP, "
            f"{len(adapter) // 2} modules): the adapter {p.model_bytes / 1e6:.1f} MB "
            f"({p.model_bytes / model:.2%} of the model), sent {p.sent_bytes / 1e6:.1f} MB over "
            f"{p.links} links; predicted {p.seconds * 1e3:.1f} ms"
        )
    head = (
        f"{config}: {len(specs)} tensors; trainer {trainer_gpus} GPUs (FSDP "
        f"{cluster.fsdp} x TP {trainer_tp}, {trainer_dtype}) -> {engines} engines x TP "
        f"{engine_tp} ({engine_dtype}); {gpus_per_host} GPUs per host, NVLink "
        f"{nvlink_gbytes:g} GB/s, network {network_gbits:g} Gb/s per GPU; {update_ms:g} ms "
        f"an update, {link_ms:g} ms for each more link of a rank, {bucket_ms:g} ms for each "
        f"more bucket; {buffer_gib:g} GiB of link buffers a rank"
        + (f"; block FP8 quantized at {quantize_gbytes:g} GB/s a trainer rank"
           if engine_dtype == BLOCK_FP8 else "")
    )  # fmt: skip
    return "\n".join([head, *lines])
