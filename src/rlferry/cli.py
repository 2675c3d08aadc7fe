"""The ``rlferry`` command: ``rlferry --version``, ``rlferry serve queue``.

The benchmarks are scripts in the repository's ``benchmarks/`` folder, not commands.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import __version__


def _serve_queue_parser(sub: Any) -> None:
    sq = sub.add_parser(
        "queue",
        help="a queue: the controller here, each storage unit its own process",
        description="Serve a rollout queue until SIGINT/SIGTERM. Prints `controller ADDRESS` "
        "first, then one line per storage unit; clients use Queue.connect(ADDRESS).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sq.add_argument("--storage-units", type=int, default=2, help="storage unit processes")
    sq.add_argument(
        "--tasks",
        default="train",
        help="comma-separated task names: the consumers that each read every sample once "
        "(e.g. actor_train,critic_train)",
    )
    sq.add_argument(
        "--capacity", type=int, default=None, help="samples held at most (a put waits for room)"
    )
    sq.add_argument(
        "--max-partitions", type=int, default=None, help="unfinished partitions at most"
    )
    sq.add_argument(
        "--lease-timeout",
        type=float,
        default=60.0,
        help="seconds a got batch stays leased without an ack before it is delivered again",
    )
    sq.add_argument(
        "--bind",
        default=None,
        help="the controller's address (default: a fresh ipc:// path; tcp://127.0.0.1:* for a "
        "free loopback port; off loopback needs --secret)",
    )
    sq.add_argument(
        "--secret",
        default=None,
        help="shared secret of 16 bytes or more (CURVE); every client passes the same",
    )


def _serve_engine_parser(sub: Any) -> None:
    se = sub.add_parser(
        "engine",
        help="a generation engine (HFEngine or VLLMEngine) over HTTP",
        description="Serve a causal LM from a local directory until SIGINT/SIGTERM. "
        "Prints `engine URL NAME` once it answers; a coordinator drives it with "
        "RemoteEngine(URL). Needs the [hf] extra (--engine hf) or [vllm] (--engine vllm).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    se.add_argument("--model", required=True, help="a local directory (save_pretrained)")
    se.add_argument(
        "--engine", choices=("hf", "vllm"), default="hf",
        help="hf: HFEngine (transformers); vllm: VLLMEngine (an AsyncLLM, token ids only)",
    )  # fmt: skip
    se.add_argument("--host", default="127.0.0.1", help="off loopback needs --token")
    se.add_argument("--port", type=int, default=0, help="0: a free port")
    se.add_argument("--token", default=None, help="a shared token of 16 bytes or more")
    se.add_argument(
        "--name", default=None, help="the engine's name (default: hf-PID-N, vllm-PID-N)"
    )
    se.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: the model's)")
    se.add_argument("--max-batch", type=int, default=64, help="rows decoded together at most")
    se.add_argument(
        "--max-model-len", type=int, default=None,
        help="prompt + max_tokens at most (default: the model's; on CUDA the slot cache holds "
        "max-batch x this many tokens, 2048 at most by default, and a step attends over them)",
    )  # fmt: skip
    se.add_argument(
        "--nice", type=int, default=0,
        help="lower the engine's CPU priority by this much (0-19): on cores shared with "
        "trainers, their steps take the CPU first and the engine the rest",
    )  # fmt: skip
    se.add_argument(
        "--lora", type=int, default=None, metavar="RANK",
        help="serve base + a LoRA adapter of this rank, pushed as PEFT names its tensors "
        "(--engine hf)",
    )  # fmt: skip
    se.add_argument("--lora-alpha", type=float, default=None,
                    help="the adapter's alpha (default: 2 x its rank)")  # fmt: skip
    se.add_argument("--lora-targets", default=None,
                    help="the adapter's target modules, comma separated (default: every linear "
                    "layer of the attention and the MLP, q_proj to down_proj)")  # fmt: skip


def _lora(a: Any) -> Any:
    """``serve engine``'s adapter (a ``LoraConfig``), or None without ``--lora``."""
    if a.lora is None:
        return None
    from rlferry.engines.lora import TARGETS, LoraConfig

    names = a.lora_targets.split(",") if a.lora_targets is not None else TARGETS
    targets = tuple(t.strip() for t in names if t.strip())
    alpha = 2.0 * a.lora if a.lora_alpha is None else a.lora_alpha
    return LoraConfig(rank=a.lora, alpha=alpha, target_modules=targets)


def _demo_parser(sub: Any) -> None:
    d = sub.add_parser(
        "demo",
        help="asynchronous GRPO end to end: engines, coordinator, queue, 2 DP trainers",
        description="Asynchronous GRPO on a small random-init model learning to reverse 5 "
        "letters: engine processes, a coordinator, a queue and two data-parallel trainer "
        "processes, weights pushed every step. Writes OUT/report.md with plots. Needs the "
        "[demo] extra.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument("--steps", type=int, default=200, help="training steps per run")
    d.add_argument("--engines", type=int, default=2, help="engine processes")
    d.add_argument("--max-staleness", type=int, default=2, help="0 = synchronous")
    d.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    d.add_argument(
        "--engine", choices=("hf", "vllm"), default="hf",
        help="hf: HFEngine; vllm: VLLMEngine (the [vllm] extra, on the CPU)",
    )  # fmt: skip
    d.add_argument(
        "--layout", choices=("colocated", "split"), default="colocated",
        help="with --device cuda: colocated (engines on GPU 0 beside trainer rank 0, "
        "cuda_ipc) or split (engines on the first half of the GPUs, a trainer rank on each "
        "other GPU, NCCL broadcast)",
    )  # fmt: skip
    d.add_argument("--model", choices=("tiny", "small", "qwen3-0.6b"), default="tiny")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--groups-per-step", type=int, default=argparse.SUPPRESS, metavar="N",
        help="GRPO groups of 8 samples a training step, even (default: 16 on the CPU, 64 with "
        "--device cuda)",
    )  # fmt: skip
    d.add_argument("--out", default="rlferry-demo", help="where the report goes")
    d.add_argument(
        "--compare", action="store_true",
        help="a synchronous run, then an asynchronous one, in one report",
    )  # fmt: skip
    d.add_argument(
        "--no-mps", action="store_true",
        help="colocated on CUDA, run without NVIDIA MPS (by default an asynchronous run "
        "starts an MPS daemon of its own, so that the engines' and the trainer's kernels run "
        "side by side; a synchronous run goes without)",
    )  # fmt: skip
    d.add_argument(
        "--no-sync", action="store_true",
        help="engines never receive weights (the control run: the reward stays flat)",
    )  # fmt: skip
    d.add_argument(
        "--launcher", choices=("local", "ray"), default="local",
        help="local: child processes; ray: every process a Ray actor (the [ray] extra)",
    )  # fmt: skip
    d.add_argument(
        "--lora", type=int, default=None, metavar="RANK",
        help="train a LoRA adapter of this rank on the frozen base and push it alone each step "
        "(alpha 2 x rank; GRPO's lr 3e-3 on tiny and small, 3e-4 on qwen3-0.6b)",
    )  # fmt: skip
    d.add_argument(
        "--ray-address", default=None, metavar="ADDR",
        help="with --launcher ray: the cluster to join (default: a local Ray, started and "
        "stopped by the run)",
    )  # fmt: skip
    d.add_argument(
        "--checkpoint-every", type=int, default=None, metavar="N",
        help="a job checkpoint every N steps (the trainer's weights and optimizer, the queue, "
        "the coordinator's versions, the prompts in flight), the last 2 kept",
    )  # fmt: skip
    d.add_argument(
        "--checkpoint-dir", default=None, metavar="DIR",
        help="where the checkpoints go (default: OUT/checkpoints, or the --resume directory)",
    )  # fmt: skip
    d.add_argument(
        "--resume", default=None, metavar="DIR",
        help="continue the job whose checkpoints are in DIR from its last whole one, to --steps "
        "(the same settings; OUT/trained.jsonl is cut back to that step and continued)",
    )  # fmt: skip


def _plan_weights_parser(sub: Any) -> None:
    pw = sub.add_parser(
        "plan-weights",
        help="predict a sharded weight update on a cluster: bytes per link, the busiest, the time",
        description="Plan a sharded weight update (every trainer rank sends what it owns to "
        "the engine ranks that need it) for a transformers model built on the meta device "
        "(nothing is downloaded), and predict its time from the busiest link.",
    )
    pw.add_argument("--config", required=True, help="a config.json path, a transformers "
                    "configuration class name (Qwen3MoeConfig), or a preset: qwen3-235b-a22b, "
                    "kimi-k2")  # fmt: skip
    pw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a configuration value (JSON when it parses), repeatable")  # fmt: skip
    pw.add_argument("--trainer-gpus", type=int, required=True, help="trainer ranks (FSDP x TP)")
    pw.add_argument("--trainer-tp", type=int, default=1)
    pw.add_argument("--trainer-dtype", default="bfloat16")
    pw.add_argument("--engines", type=int, required=True, help="engine replicas")
    pw.add_argument("--engine-tp", type=int, required=True, help="GPUs per engine (TP)")
    pw.add_argument("--engine-dtype", default="float8_e4m3fn",
                    help="a torch dtype name (float8_e4m3fn: a cast without scales), or "
                    "fp8_block128: linear layers' weights in block FP8, a float32 scale per "
                    "128 x 128 block, quantized on each trainer rank's GPU")  # fmt: skip
    pw.add_argument("--gpus-per-host", type=int, default=8)
    pw.add_argument("--nvlink-gbytes", type=float, default=450.0,
                    help="GB/s per GPU and direction within a host (H100 NVLink: 450)")  # fmt: skip
    pw.add_argument("--network-gbits", type=float, default=400.0,
                    help="Gb/s per GPU and direction across hosts (default 400)")  # fmt: skip
    pw.add_argument("--update-ms", type=float, default=None,
                    help="what an update costs besides its bytes with one link a rank "
                    "(default 1.5: a 4 MB update of one rank to one on H200s; cuda_ipc writes "
                    "within one host: 0.6)")  # fmt: skip
    pw.add_argument("--link-ms", type=float, default=None,
                    help="and for each more link of the trainer rank with the most, "
                    "and again of the engine rank with the most (default 0.55; cuda_ipc "
                    "writes: 0.15)")  # fmt: skip
    pw.add_argument("--bucket-ms", type=float, default=None,
                    help="and for each more bucket of the rank with the most "
                    "(default 0.09; cuda_ipc writes: 0)")  # fmt: skip
    pw.add_argument("--buffer-gib", type=float, default=None,
                    help="what a rank's link buffers may take together (ShardedSender's "
                    "buffer_bytes; default 4): more makes fewer, larger buckets")  # fmt: skip
    pw.add_argument("--quantize-gbytes", type=float, default=None,
                    help="with --engine-dtype fp8_block128: GB/s of the trainer's dtype a "
                    "trainer rank's GPU quantizes (default 1500: one H200, measured by "
                    "benchmarks/weights_fp8.py)")  # fmt: skip
    pw.add_argument("--changed", type=float, default=None, metavar="FRACTION",
                    help="also predict a delta push where this fraction of the elements "
                    "changed since the engines' version (0.02: 2%%)")  # fmt: skip
    pw.add_argument("--diff-gbytes", type=float, default=None,
                    help="with --changed: GB of pushed tensors a trainer GPU diffs against "
                    "its base a second (default 350: an H200)")  # fmt: skip
    pw.add_argument("--lora-rank", type=int, default=None, metavar="R",
                    help="also predict pushing a rank-R LoRA adapter of every linear of the "
                    "attention and the MLP instead of the model")  # fmt: skip


def _plan_weights(a: Any) -> None:
    from rlferry.weights.planning import plan_weights

    try:
        text = plan_weights(
            a.config, a.set, trainer_gpus=a.trainer_gpus, trainer_tp=a.trainer_tp,
            trainer_dtype=a.trainer_dtype, engines=a.engines, engine_tp=a.engine_tp,
            engine_dtype=a.engine_dtype, gpus_per_host=a.gpus_per_host,
            nvlink_gbytes=a.nvlink_gbytes, network_gbits=a.network_gbits,
            changed=a.changed, lora_rank=a.lora_rank,
            **{k: v for k, v in (("update_ms", a.update_ms), ("link_ms", a.link_ms),
                                 ("bucket_ms", a.bucket_ms), ("buffer_gib", a.buffer_gib),
                                 ("quantize_gbytes", a.quantize_gbytes),
                                 ("diff_gbytes", a.diff_gbytes))
               if v is not None},
        )  # fmt: skip
    except (ValueError, ImportError, OSError) as e:
        print(f"rlferry plan-weights: {e}", file=sys.stderr)
        sys.exit(2)
    print(text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="rlferry", description="The data plane of asynchronous RL.")
    p.add_argument("--version", action="version", version=f"rlferry {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run services that clients connect to by address")
    services = serve.add_subparsers(dest="service", required=True)
    _serve_queue_parser(services)
    _serve_engine_parser(services)
    _demo_parser(sub)
    _plan_weights_parser(sub)
    a = p.parse_args(argv)
    if a.command == "plan-weights":
        _plan_weights(a)
        return
    if a.command == "demo":
        from rlferry.rl.command import main as demo

        try:
            report = demo(a)
        except ValueError as e:  # a setting that cannot work: said before anything starts
            print(f"rlferry demo: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("rlferry demo: interrupted; every process it started was stopped",
                  file=sys.stderr)  # fmt: skip
            sys.exit(130)
        print(f"report: {report}")
        return
    if a.command == "serve" and a.service == "engine":
        from rlferry.engines._serve import serve_engine
        from rlferry.wire import SecurityError

        try:
            serve_engine(
                a.model, engine=a.engine, host=a.host, port=a.port, token=a.token, name=a.name,
                device=a.device, max_batch=a.max_batch, max_model_len=a.max_model_len,
                nice=a.nice, lora=_lora(a),
            )  # fmt: skip
        except (SecurityError, ValueError, OSError, ImportError) as e:
            print(f"rlferry serve engine: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(2)
    elif a.command == "serve":
        from rlferry.queue import QueueConfig, QueueError
        from rlferry.queue.services import serve_queue
        from rlferry.wire import SecurityError

        try:
            config = QueueConfig(
                storage_units=a.storage_units,
                tasks=tuple(t.strip() for t in a.tasks.split(",")),
                capacity=a.capacity,
                max_partitions=a.max_partitions,
                lease_timeout=a.lease_timeout,
                bind=a.bind,
                secret=a.secret,
            )
            serve_queue(config)
        except (QueueError, SecurityError) as e:
            print(f"rlferry serve queue: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    main()
