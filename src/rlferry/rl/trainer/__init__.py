"""The demo's trainer ranks: a process (or Ray actor) per data-parallel rank, its
optimizer step (a CUDA graph on one GPU), its pushes and its LoRA adapter."""

from ._lora import TrainedAdapter, lora_config
from ._process import trainer_main
from ._roofline import Peaks, measure_peaks

__all__ = ["Peaks", "TrainedAdapter", "lora_config", "measure_peaks", "trainer_main"]
