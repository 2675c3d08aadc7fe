"""Whether a CUDA demo run fits its GPU, told before anything starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlferry.errors import RequestError

if TYPE_CHECKING:
    from ._config import DemoConfig

__all__ = ["ENGINE_LEN", "check_memory"]

ENGINE_LEN = 64
"""The engines' max_model_len: the task's prompt and answer fit in 16 tokens (a slot
cache holds max_batch x max_model_len columns whatever its rows use)."""
CONTEXT_BYTES = 600 << 20
"""A CUDA context and allocator slack per process, about."""


def check_memory(config: DemoConfig, vocab_size: int) -> None:
    """Refuse a CUDA run whose processes on GPU 0 would not fit in its free memory, with the
    numbers and the flags that shrink it, before anything starts: each engine holds the
    weights in the serving dtype and a slot KV cache; the trainer ranks there hold float32
    weights, gradients and AdamW's two moments (16 bytes a parameter, over the ranks)."""
    if config.device != "cuda":
        return
    from rlferry.engines.hf._slots import SlotBatch

    from .model import model_config, transformers_module

    cfg = model_config(config.model, vocab_size)
    tf = transformers_module()
    cls = tf.Qwen3ForCausalLM if config.model == "qwen3-0.6b" else tf.LlamaForCausalLM
    with torch.device("meta"):
        meta = cls(cfg)
    params = sum(p.numel() for p in meta.parameters())
    serve = 2 if config.model == "qwen3-0.6b" else 4  # bfloat16 or float32 on CUDA
    max_batch = max(64, -(-config.groups_per_step * config.group_size // config.engines))
    length = ENGINE_LEN
    cache = SlotBatch.nbytes(meta.to(dtype=torch.bfloat16 if serve == 2 else None), max_batch,
                             length)  # fmt: skip
    colocated = config.layout == "colocated"
    engines_there = config.engines if colocated else 1  # split: one engine a GPU, no rank
    engine = serve * params + cache + CONTEXT_BYTES
    dp = config.gpus()[1]
    trainer = 16 * params // dp + CONTEXT_BYTES if colocated else 0
    need = engines_there * engine + trainer
    free, total = torch.cuda.mem_get_info(0)
    if need > 0.9 * free:
        gib = 2**30
        raise RequestError(
            f"device: the run needs about {need / gib:.1f} GiB on GPU 0 ({engines_there} "
            f"engine(s) x ({serve * params / gib:.2f} GiB of weights + {cache / gib:.2f} GiB "
            f"of KV cache) + a trainer rank's {16 * params // dp / gib:.2f} GiB), got "
            f"{free / gib:.1f} GiB free of {total / gib:.1f} (use fewer --engines, a smaller "
            "--model, or --layout split on 2 GPUs or more)"
        )
