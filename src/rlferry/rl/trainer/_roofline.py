"""What a training step must cost at least: its FLOPs and bytes at the device's own rates.

:func:`step_roofline` counts a step of a decoder-only model on ``rows`` sequences of
``width`` tokens (the padded shape the GPU computes):

- FLOPs: ``6 N T`` for the ``N`` weights of its linear layers over ``T = rows x width``
  tokens (forward 2, backward 4), and causal attention's ``3 x 2 x rows x width^2 x
  heads x head_dim`` a layer;
- bytes: a parameter's fused AdamW step (read the weight, its gradient and both moments,
  write the weight and the moments: 28 bytes in float32), gradient clipping (a read for
  the norm, a read and a write to scale: 12), the gradient's write (4), and under
  autocast the weight's cast (read 4, write 2) and the low-precision copies the
  forward, the backward and the weight gradient read and write (8); activations
  written in the forward and read in the backward (``2 x 34 x hidden x T`` a layer:
  Korthikanti et al., 2022).

The estimate is ``FLOPs / peak FLOP rate + bytes / peak bandwidth`` (the matrix products
and the optimizer's memory-bound pass run one after the other), at rates
:func:`measure_peaks` measures on the device itself (the demo's driver, before any other
process uses it): the best of a few large matrix products in the forward's dtype and of a
few device copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Peaks", "Roofline", "measure_peaks", "step_roofline"]


@dataclass(frozen=True)
class Peaks:
    """A device's measured rates: ``flops`` per second (matrix products in ``dtype``) and
    ``bandwidth`` in bytes per second (a copy's read and write)."""

    flops: float
    bandwidth: float
    dtype: str


@dataclass(frozen=True)
class Roofline:
    """A step's ``flops`` and ``bytes`` and the least time they take at ``peaks``."""

    flops: float
    bytes: float
    peaks: Peaks

    @property
    def seconds(self) -> float:
        return self.flops / self.peaks.flops + self.bytes / self.peaks.bandwidth


def measure_peaks(device: torch.device, dtype: torch.dtype) -> Peaks:
    """The best rate of 5 matrix products (``8192^3`` on CUDA, ``1024^3`` on the CPU) in
    ``dtype`` and of 5 copies (1 GiB on CUDA, 128 MiB on the CPU) on ``device``."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    src = torch.empty((1 << 30) if cuda else (128 << 20), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)

    def best(fn: Any) -> float:
        fn()  # warm-up: cuBLAS's choice, the pages' first touch
        times = []
        for _ in range(5):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    matmul = best(lambda: torch.mm(a, b))
    copy = best(lambda: dst.copy_(src))
    return Peaks(2 * n**3 / matmul, 2 * src.numel() / copy, str(dtype).removeprefix("torch."))


def step_roofline(model: Any, rows: int, width: int, *, low: bool, peaks: Peaks) -> Roofline:
    """The roofline of one step of ``model`` (a ``transformers`` causal LM) on ``rows`` x
    ``width`` tokens; ``low``: the forward runs under autocast to a 2-byte dtype."""
    cfg = model.config
    tokens = rows * width
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    layers = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 3 * 2 * rows * width**2 * cfg.num_attention_heads * head_dim * layers
    flops = 6 * linear * tokens + attention
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_param = 28 + 12 + 4 + (6 + 8 if low else 8)  # fp32 weights: the forward/backward reads
    activations = 2 * 34 * cfg.hidden_size * tokens * layers
    return Roofline(float(flops), float(params * per_param + activations), peaks)
