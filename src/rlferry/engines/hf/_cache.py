"""Which running batch an :class:`~rlferry.engines.hf.HFEngine` decodes with: a slot KV
cache (``_slots.py``: CUDA graphs, CUDA's default) or transformers' dynamic cache
(``_batch.py``), chosen for the model and checked against the device's free memory."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from rlferry.errors import RequestError

from ._batch import Batch
from ._kernels import GQA_SDPA, fuse_mlps, fuse_rms_norms, fuse_rotary, use_gqa_sdpa
from ._model import Loaded
from ._slots import SlotBatch

__all__ = ["SLOT_LEN", "Chosen", "choose_batch"]

SLOT_LEN = 2048
"""The default ``max_model_len`` of a slot cache (each slot holds that many tokens)."""


@dataclass(frozen=True)
class Chosen:
    """The batch, its cache's kind (``"slots"`` or ``"dynamic"``) and the engine's
    ``max_model_len`` (None: the model does not say)."""

    batch: Batch | SlotBatch
    kv_cache: str
    max_model_len: int | None


def check_room(model: Any, device: torch.device, max_batch: int, max_len: int) -> None:
    """Refuse a slot cache that would not fit in the device's free memory, with the numbers
    and the settings that shrink it, before anything is allocated."""
    need = SlotBatch.nbytes(model, max_batch, max_len)
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if need > 0.9 * free:
        raise RequestError(
            f"HFEngine: the KV cache of {max_batch} slots x {max_len} tokens needs "
            f"{need / 2**30:.2f} GiB, got {free / 2**30:.2f} GiB free of {total / 2**30:.2f} "
            f"GiB on {device} (lower max_batch or max_model_len)"
        )


def choose_batch(
    loaded: Loaded,
    kv_cache: str | None,
    *,
    max_batch: int,
    max_model_len: int | None,
    max_prefill: int,
    cuda_graphs: bool,
) -> Chosen:
    """The batch of ``loaded``'s model: ``kv_cache`` (None: slots on CUDA where the model
    allows them, else dynamic). With slots, the model is changed to compute the same values
    faster (see ``HFEngine``)."""
    model, device = loaded.model, loaded.device
    params = inspect.signature(model.forward).parameters
    kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    impl = getattr(model.config, "_attn_implementation", None)
    sdpa = impl in ("sdpa", GQA_SDPA)
    slots_ok = (impl == "eager" or sdpa) and not loaded.sliding and kw == "logits_to_keep"
    if kv_cache is None:
        kv_cache = "slots" if device.type == "cuda" and slots_ok else "dynamic"
    if kv_cache == "slots" and not slots_ok:
        raise RequestError(
            f"HFEngine.kv_cache: expected 'dynamic' for this model, got 'slots' (slots need "
            f"eager or sdpa attention, no sliding-window layers and logits_to_keep; this "
            f"model has attention {impl!r}, sliding={loaded.sliding})"
        )
    if kv_cache != "slots":
        batch = Batch(model, device, loaded.new_cache, kw, loaded.sliding)
        return Chosen(batch, kv_cache, max_model_len or loaded.max_len)
    length = max_model_len or min(loaded.max_len or SLOT_LEN, SLOT_LEN)
    check_room(model, device, max_batch, length)
    if impl == "sdpa":  # the same attention, without copying the cache per step
        use_gqa_sdpa(model)
    # the same values in fewer kernels; with graphs, compiled (their host costs vanish in
    # the graphs; the compilations are made by the captures' warm-up runs)
    graphed = cuda_graphs and device.type == "cuda"
    fuse_rms_norms(model, compiled=graphed)
    if graphed:  # for the process: see fuse_rotary
        fuse_rotary(model)
        fuse_mlps(model)
    slots = SlotBatch(
        model, device, max_batch=max_batch, max_len=length,
        graphs=cuda_graphs and device.type == "cuda", max_prefill=max_prefill,
    )  # fmt: skip
    return Chosen(slots, kv_cache, length)
