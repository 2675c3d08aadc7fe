"""HFEngine benchmark: tokens/s of the engine against ``model.generate`` on the same batch.

A random-init Llama-shaped model is made in code (nothing downloaded). Both generate
for the same ``--batch`` prompts of mixed lengths (left padded for ``model.generate``;
the engine pads the same way in its own loop), on one device, in one process, taking
turns run by run so that a drift of the machine falls on both alike. Each runs on a
thread of its own: on the CPU every thread that calls torch has its own OpenMP team,
and with two teams alive (the main thread's, from building the model, and the
engine's) libgomp throttles their spin-waits, which slows small CPU ops (a 16x256
matmul 1.6x on the 2-core VM); model.generate on a thread of its own pays the same
as the engine's decode thread. Three cases:

- ``greedy`` and ``sampled`` (temperature 1, top-p 1: ``model.generate(...,
  do_sample=True, top_k=0)``): every sequence ``--new-tokens`` long, no stop token;
- ``sampled, stop tokens``: as RL rollouts end, each sequence at its own length: the
  same ``--stop`` token ids end every sequence (``eos_token_id`` for
  ``model.generate``, which pads a finished sequence until the last one ends; the
  engine drops it from its batch). Only the tokens up to each stop count.

Each row is ``--repeat`` timed runs after a warm-up; tokens/s is the tokens generated
over the run's wall time (for the engine: from submitting the requests to the last
completion); p50, p90 and max over the runs. ``model.generate`` runs on its own copy of
the model, as transformers ships it (its SDPA attention, RMSNorm and rotary embedding),
not the kernels the engine sets on the model it serves.

    python benchmarks/engine.py                  # CPU, small defaults (about a minute)
    python benchmarks/engine.py --device cuda --batch 64 --hidden 1024 --layers 16
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import copy
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import torch

from rlferry.control import GenerateRequest, SamplingParams
from rlferry.engines.hf import HFEngine

from _common import table


def make_model_config(args: argparse.Namespace) -> Any:
    import transformers

    if args.model == "qwen3-0.6b":  # its shapes
        args.vocab = 151936
        return transformers.Qwen3Config(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            tie_word_embeddings=True, max_position_embeddings=4096,
        )  # fmt: skip
    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
        intermediate_size=args.hidden * 8 // 3, max_position_embeddings=4096,
    )  # fmt: skip


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    """A random-init model of ``--model``'s shapes on ``--device`` in ``--dtype``."""
    import transformers

    torch.manual_seed(0)
    config = make_model_config(args)
    cls = (
        transformers.Qwen3ForCausalLM
        if args.model == "qwen3-0.6b"
        else transformers.LlamaForCausalLM
    )
    return cls(config).to(args.device, getattr(torch, args.dtype)).eval()


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.batch,), generator=g)
    return [torch.randint(3, args.vocab, (int(n),), generator=g).tolist() for n in lengths]


@contextlib.contextmanager
def stock_rotary(model: torch.nn.Module) -> Iterator[None]:
    """transformers' own rotary embedding for ``model``'s family while inside: the engine
    rotates q and k together for the whole process (``fuse_rotary``), and the baseline
    runs as transformers ships it."""
    module = sys.modules[type(model).__module__]
    fused = getattr(module, "apply_rotary_pos_emb", None)
    if fused is None:
        yield
        return
    module.apply_rotary_pos_emb = getattr(fused, "rlferry_original", fused)
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = fused


def hf_generate(
    model: torch.nn.Module, prompts: list[list[int]], new: int, sample: bool, stop: list[int]
) -> int:
    """``model.generate`` on the left-padded batch; the tokens generated (each sequence's
    up to its first stop token)."""
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    device = next(model.parameters()).device
    with torch.inference_mode(), stock_rotary(model):
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
            min_new_tokens=None if stop else new, do_sample=sample, top_k=0, top_p=1.0,
            temperature=1.0, pad_token_id=0, eos_token_id=stop or None,
        )  # fmt: skip
    generated = out[:, width:].cpu()
    if not stop:
        return generated.numel()
    ends = torch.isin(generated, torch.tensor(stop)).int()
    # A sequence's length: up to and with its first stop token (all of it if none came).
    return sum(int(row.argmax()) + 1 if row.any() else len(row) for row in ends)


async def engine_generate(
    engine: HFEngine, prompts: list[list[int]], params: SamplingParams, run: int
) -> int:
    done = await asyncio.gather(*(
        engine.generate(GenerateRequest(request_id=f"{run}-{i}", prompt_ids=p, params=params))
        for i, p in enumerate(prompts)
    ))  # fmt: skip
    return sum(len(c.token_ids) for c in done)


async def timed(fns: list[Callable[[], Awaitable[int]]], repeat: int) -> list[list[float]]:
    """Tokens/s of each of ``fns`` over ``repeat`` rounds (after one warm-up round), the
    runs of each round taken in turn."""
    rates: list[list[float]] = [[] for _ in fns]
    for round_ in range(repeat + 1):
        for fn, out in zip(fns, rates, strict=True):
            t0 = time.perf_counter()
            tokens = await fn()
            if round_:
                out.append(tokens / (time.perf_counter() - t0))
    return rates


def cells(rates: list[float]) -> list[str]:
    q = statistics.quantiles(rates, n=10, method="inclusive") if len(rates) > 1 else rates * 9
    return [f"{statistics.median(rates):,.0f}", f"{q[8]:,.0f}", f"{max(rates):,.0f}"]


async def main(args: argparse.Namespace) -> str:
    model = make_model(args)
    prompts = make_prompts(args)
    g = torch.Generator().manual_seed(2)
    stop = torch.randperm(args.vocab, generator=g)[: args.stop].tolist()
    cases = [("greedy", False, []), ("sampled", True, []), ("sampled, stop tokens", True, stop)]
    rows = []
    runs = iter(range(1 << 30))
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="generate")
    loop = asyncio.get_running_loop()
    length = args.prompt_len + args.new_tokens
    # The baseline's own copy, made before the engine sets its attention and norms on
    # ``model``: model.generate runs transformers' SDPA, RMSNorm and rotary embedding.
    stock = copy.deepcopy(model)
    engine = HFEngine(model, name="bench", max_batch=args.batch, max_model_len=length)
    with pool, engine:
        for case, sample, stops in cases:
            params = SamplingParams(
                max_tokens=args.new_tokens, temperature=1.0 if sample else 0.0,
                stop_token_ids=tuple(stops),
            )  # fmt: skip

            async def hf(sample: bool = sample, stops: list[int] = stops) -> int:
                return await loop.run_in_executor(
                    pool, hf_generate, stock, prompts, args.new_tokens, sample, stops
                )

            async def ours(params: SamplingParams = params) -> int:
                return await engine_generate(engine, prompts, params, next(runs))

            base, mine = await timed([hf, ours], args.repeat)
            ratio = statistics.median(mine) / statistics.median(base)
            rows.append([f"model.generate, {case}", *cells(base), "1.00"])
            rows.append([f"HFEngine ({engine.kv_cache}), {case}", *cells(mine), f"{ratio:.2f}"])
    out = table(rows, ["run", "tokens/s p50", "p90", "max", "vs generate (p50)"])
    if engine.kv_cache == "slots":
        out += "\n\n" + decode_steps(model, prompts, args)
    return out


def decode_steps(model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace) -> str:
    """One decode step of the slot batch (``--batch`` rows, their prompts prefilled): its
    wall time (graph replay, sampling, the one host sync), p50/p90/max over 50 steps,
    and the share of it the GPU spends in the replayed forward (timed back to back)."""
    from rlferry.engines.hf._batch import Row
    from rlferry.engines.hf._slots import SlotBatch

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    steps = 50
    batch = SlotBatch(model, device, max_batch=args.batch, graphs=cuda,
                      max_len=args.prompt_len + steps + 8)  # fmt: skip
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0)
    rows = [Row(GenerateRequest(request_id=str(i), prompt_ids=p, params=params), None, None)  # type: ignore[arg-type]
            for i, p in enumerate(prompts)]  # fmt: skip
    with torch.inference_mode():
        batch.prefill(rows, 0)
        batch.decode(0)
        times = []
        for _ in range(steps - 2):
            t0 = time.perf_counter()
            batch.decode(0)
            times.append(time.perf_counter() - t0)
        busy = ""
        if cuda and args.profile:
            print(profile(batch, args.batch))
        if cuda:
            graph = batch._graphs[batch.step_key()]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
            forward = (time.perf_counter() - t0) / 20
            busy = f"{forward * 1e3:.2f} ms ({forward / statistics.median(times):.0%})"
    q = statistics.quantiles(times, n=10, method="inclusive")
    ms = [f"{x * 1e3:.2f}" for x in (statistics.median(times), q[8], max(times))]
    header = ["decode step, rows", "p50 ms", "p90", "max", "forward alone (GPU share)"]
    return table([[str(args.batch), *ms, busy or "-"]], header)


def attention(args: argparse.Namespace) -> str:
    """One layer's attention of a one-token step over ``--batch`` rows of the slot cache's
    layout (KV heads x ``--prompt-len`` columns, a float mask), per SDPA path: cuDNN's
    grouped-query attention (the engine's where it runs), the query heads viewed as
    groups of the KV heads on each backend, and the KV heads repeated (transformers'
    ``repeat_kv``). p50 of 50 calls, each synchronized."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    cfg = make_model_config(args)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    b, w = args.batch, args.prompt_len
    k, v = (torch.randn((b, kv, w, dim), device=device, dtype=dtype) for _ in range(2))
    q = torch.randn((b, heads, 1, dim), device=device, dtype=dtype)
    mask = torch.zeros((b, 1, 1, w), device=device, dtype=dtype)
    grouped = q.reshape(b, kv, heads // kv, dim)
    n = heads // kv
    cudnn, efficient, math = (
        [SDPBackend.CUDNN_ATTENTION],
        [SDPBackend.EFFICIENT_ATTENTION],
        [SDPBackend.MATH],
    )
    cases = [
        ("cuDNN, enable_gqa", cudnn, lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True)),
        ("cuDNN, grouped view", cudnn, lambda: sdpa(grouped, k, v, attn_mask=mask)),
        ("memory-efficient, grouped view", efficient, lambda: sdpa(grouped, k, v, attn_mask=mask)),
        ("math, grouped view", math, lambda: sdpa(grouped, k, v, attn_mask=mask)),
        ("KV heads repeated (repeat_kv), default backends", None, lambda: sdpa(
            q, k.repeat_interleave(n, 1), v.repeat_interleave(n, 1), attn_mask=mask)),
    ]  # fmt: skip
    rows = []
    for name, backends, fn in cases:
        try:
            with contextlib.nullcontext() if backends is None else sdpa_kernel(backends):
                times = []
                for i in range(51):
                    t0 = time.perf_counter()
                    fn()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if i:
                        times.append(time.perf_counter() - t0)
            rows.append([name, f"{statistics.median(times) * 1e6:,.0f}"])
        except RuntimeError as e:  # this backend has no kernel for these inputs here
            rows.append([name, f"not run: {str(e).splitlines()[0][:80]}"])
    return table(rows, [f"attention, {b} rows x {w} columns, one layer", "p50 us"])


def profile(batch: object, rows: int) -> str:
    """The GPU kernels of one decode step run eagerly (no graph), by CUDA time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    key = batch.step_key()  # type: ignore[attr-defined]
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        batch._step(key)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
    return str(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--model", choices=("llama", "qwen3-0.6b"), default="llama",
        help="llama: the shapes of the flags below; qwen3-0.6b: Qwen3-0.6B's",
    )  # fmt: skip
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=16, help="prompts per run")
    p.add_argument("--prompt-len", type=int, default=64, help="longest prompt (shortest: half)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per sequence, at most")
    p.add_argument("--stop", type=int, default=256, help="stop token ids (of the vocabulary)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="print one eager decode step's kernels")
    p.add_argument(
        "--attention", action="store_true",
        help="only time one layer's attention per SDPA path (--batch rows, --prompt-len columns)",
    )  # fmt: skip
    return p.parse_args()


if __name__ == "__main__":
    args = parse()
    import transformers

    print(
        f"# {'SDPA paths' if args.attention else 'HFEngine vs model.generate'}: "
        f"{platform.node()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {args.device} ({args.dtype}), "
        f"{torch.get_num_threads()} threads; batch {args.batch}, prompts "
        f"{args.prompt_len // 2}-{args.prompt_len} tokens, up to {args.new_tokens} new "
        f"tokens ({args.stop} stop ids in the stop case); "
        + (
            "Qwen3-0.6B shapes"
            if args.model == "qwen3-0.6b"
            else f"Llama {args.layers} layers x {args.hidden}, vocab {args.vocab}"
        )
        + f"; {args.repeat} runs\n"
    )
    print(attention(args) if args.attention else asyncio.run(main(args)))
