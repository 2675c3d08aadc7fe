"""The demo's LoRA training (``rlferry demo --lora RANK``): each trainer rank trains an
adapter of that rank on the warm-started base (frozen, whole on every rank), the ranks
average the adapter's gradients, and rank 0 pushes the adapter alone.

The adapter is ``peft``'s when it is installed (``pip install 'rlferry[lora]'``), else
rlferry's own (:class:`rlferry.engines.lora.LoraLayers`, trainable); both name its tensors
as PEFT saves them and start as PEFT does (A Kaiming-uniform, B zero: the base model's
output), every rank from the same seed."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch
import torch.distributed as dist

from rlferry.engines.lora import TARGETS, LoraConfig, LoraLayers, peft_adapter

__all__ = ["LORA_ALPHA", "TrainedAdapter", "lora_config"]

LORA_ALPHA = 2.0
"""The demo's adapter alpha per unit of rank: alpha = 2 x rank (a scaling of 2)."""


def lora_config(rank: int) -> LoraConfig:
    """The adapter the demo trains and its engines serve: every linear layer of the
    attention and the MLP."""
    return LoraConfig(rank=rank, alpha=LORA_ALPHA * rank, target_modules=TARGETS)


class TrainedAdapter:
    """An adapter of ``rank`` trained on ``model`` (its base weights frozen); ``use_peft``:
    whether to use peft (None: when it is installed)."""

    def __init__(self, model: Any, rank: int, seed: int, use_peft: bool | None = None) -> None:
        self.config = lora_config(rank)
        for w in model.parameters():
            w.requires_grad_(False)
        # the base, as the engines hold it: named as the model's state dict, before peft
        # wraps its layers (the same tensors)
        self.base = list(model.state_dict().items())
        found = importlib.util.find_spec("peft") is not None
        self.peft = found if use_peft is None else use_peft
        if self.peft:
            import peft

            torch.manual_seed(seed)  # peft draws A from torch's generator: every rank alike
            cfg = peft.LoraConfig(r=rank, lora_alpha=self.config.alpha,
                               target_modules=list(TARGETS), lora_dropout=0.0)  # fmt: skip
            self.model = peft.get_peft_model(model, cfg)
            self.params = [t for n, t in self.model.named_parameters() if "lora_" in n]
            self._layers: LoraLayers | None = None
        else:
            self._layers = LoraLayers(model, self.config, trainable=True)
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for a, _ in self._layers.modules.values():
                    # PEFT's draw: kaiming_uniform_(a=sqrt(5)), bound 1 / sqrt(in_features)
                    bound = 1 / math.sqrt(a.shape[1])
                    a.copy_(torch.rand(a.shape, generator=g) * 2 * bound - bound)
            self.model = model
            self.params = self._layers.parameters()

    def average_gradients(self) -> None:
        """Average the adapter's gradients over the ranks (one all-reduce)."""
        world = dist.get_world_size()
        if world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world
        at = 0
        for p, g in zip(self.params, grads, strict=True):
            p.grad = flat[at : at + g.numel()].view_as(g)
            at += g.numel()

    def named(self, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        """The adapter to push: A and B in ``dtype`` (the engines'), then its config."""
        if self._layers is not None:
            return self._layers.named(dtype)
        return peft_adapter(self.model, dtype=dtype)

    def served(self, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        """What an engine serving it holds, in its order: the base, then the adapter."""
        return [(n, t.to(dtype)) for n, t in self.base] + self.named(dtype)
