"""``HFEngine``: a Hugging Face ``transformers`` causal LM as an rlferry generation engine
(the ``[hf]`` extra). Its decode loop runs on a thread (``_thread.py``) over one of two
batches: a slot KV cache with CUDA-graph decode steps (``_slots.py``, CUDA's default) or
transformers' dynamic cache (``_batch.py``)."""

from ._cache import SLOT_LEN
from ._engine import HFEngine

__all__ = ["SLOT_LEN", "HFEngine"]
