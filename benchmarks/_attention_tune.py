"""Attention in a compiled training step, per row width: the trainer's short attention
(``rlferry.rl.trainer._attention.short_attention``: two batched products and a softmax)
against transformers' SDPA (cuDNN's or flash attention where PyTorch picks them), each
compiled as a decoder layer is, forward and backward, Qwen3-0.6B's heads (16 query, 8
key-value, 128 wide) in bfloat16 under a causal mask, ``--tokens`` tokens a batch. Prints
the device time of each (its kernels' time summed by ``torch.profiler``: in a CUDA graph
nothing else counts) and their ratio; the widths where the short path wins bound ``SHORT``.

    python benchmarks/_attention_tune.py --widths 12,32,64,128,256,512
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from rlferry.rl.trainer._attention import short_attention

from _common import table


def _kernel_ms(fn: Any, repeat: int = 5) -> float:
    """The device time of ``fn``'s kernels, ms a call, after two warm-up calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / repeat


class _Module(torch.nn.Module):
    """What transformers' attention functions read of a Qwen3-0.6B layer."""

    is_causal = True
    num_key_value_groups = 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="12,32,64,128,256,512")
    p.add_argument("--tokens", type=int, default=6144)
    a = p.parse_args()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dev, dt = torch.device("cuda"), torch.bfloat16
    layer = _Module()
    rows_out = []
    for width in (int(w) for w in a.widths.split(",")):
        b = max(1, a.tokens // width)
        q = torch.randn(b, 16, width, 128, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(b, 8, width, 128, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(b, 8, width, 128, device=dev, dtype=dt, requires_grad=True)
        mask = torch.ones((width, width), dtype=torch.bool, device=dev).tril()[None, None]
        times = {}
        for name, fn in (("sdpa", sdpa_attention_forward), ("short", short_attention)):
            compiled = torch.compile(fn, dynamic=False)

            def step(compiled: Any = compiled, args: tuple = (q, k, v, mask)) -> None:
                out, _ = compiled(layer, *args, scaling=128**-0.5)
                out.float().square().sum().backward()

            times[name] = _kernel_ms(step)
            torch._dynamo.reset()
        rows_out.append([f"{b} x {width}", f"{times['sdpa']:.3f}", f"{times['short']:.3f}",
                         f"{times['sdpa'] / times['short']:.2f}x"])  # fmt: skip
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; device ms a forward "
          "and backward (kernels summed, 5 calls)")  # fmt: skip
    print(table(rows_out, ["rows x width", "SDPA", "short", "short's speed-up"]))


if __name__ == "__main__":
    main()
