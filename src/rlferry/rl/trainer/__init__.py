"""The demo's trainer ranks: a process (or Ray actor) per data-parallel rank, its
optimizer step (a CUDA graph on one GPU), its pushes and its LoRA adapter."""

from ._lora import TrainedAdapter, lora_config
from ._process import trainer_main

__all__ = ["TrainedAdapter", "lora_config", "trainer_main"]
