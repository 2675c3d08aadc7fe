"""A pushed LoRA adapter inside vLLM's worker: checked against vLLM's LoRA support when the
plan comes, gathered from the push's buckets, and handed to vLLM's LoRA manager from memory
(``LoRAModel.from_lora_tensors``, nothing written to disk) once the push committed.

vLLM serves it to the requests that name it (``LoRARequest(ADAPTER_NAME, ADAPTER_ID, ...)``:
``VLLMEngine`` does once a push brought one); each push replaces it under the same id."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rlferry.weights.planning import TensorSpec

from ..lora import CONFIG_NAME, LoraMismatch, adapter_module, is_adapter_name

__all__ = ["ADAPTER_ID", "ADAPTER_NAME", "ADAPTER_PATH", "PushedAdapter", "max_lora_rank"]

ADAPTER_ID = 1
"""The adapter's ``lora_int_id`` in vLLM (one adapter at a time, replaced by each push)."""
ADAPTER_NAME = "rlferry-adapter"
ADAPTER_PATH = "rlferry://pushed"
"""The ``lora_path`` of its ``LoRARequest``: never read (the adapter is loaded already)."""
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that serves adapters of ``rank``."""
    for r in RANKS:
        if r >= rank:
            return r
    raise LoraMismatch(f"adapter: expected a rank of at most {RANKS[-1]} (vLLM's), got {rank}")


class PushedAdapter:
    """The adapter side of a worker's weight transfer, for ``model`` (vLLM's, wrapped for
    LoRA when the engine runs with ``enable_lora``: its ``lora_manager``)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._pending: dict[str, torch.Tensor] = {}
        self.lora: Any = None  # the LoRAModel of the last adapter pushed, kept in memory

    def _manager(self) -> Any:
        return getattr(self.model, "lora_manager", None)

    def check(self, specs: Iterable[TensorSpec]) -> None:
        """Raise :class:`~rlferry.engines.lora.LoraMismatch` for adapter tensors vLLM does not
        serve here: no LoRA (vLLM started without ``enable_lora``), a rank above its
        ``max_lora_rank``, modules it has no LoRA layer for, a missing part."""
        named = [s for s in specs if is_adapter_name(s.name)]
        if not named:
            return
        manager = self._manager()
        if manager is None:
            raise LoraMismatch(
                f"adapter: `{named[0].name}`: this vLLM serves no adapter (start it with "
                "enable_lora=True: VLLMEngine(..., lora=LoraConfig(...)))"
            )
        config = next((s for s in named if s.name == CONFIG_NAME), None)
        if config is None or config.shape != (3,) or config.dtype != torch.float32:
            raise LoraMismatch(
                f"adapter: expected `{CONFIG_NAME}` float32 [3] (its rank, alpha and scaling), "
                f"got {config.describe() if config else 'none'}"
            )
        known = _expected_modules(manager)
        parts: dict[str, set[str]] = {}
        limit = manager.lora_config.max_lora_rank
        for s in named:
            if s.name == CONFIG_NAME:
                continue
            found = adapter_module(s.name)
            if found is None or found[0].rsplit(".", 1)[-1] not in known:
                raise LoraMismatch(
                    f"adapter: expected LoRA A or B weights of the modules vLLM serves LoRA on "
                    f"({', '.join(sorted(known))}), got `{s.name}`"
                )
            rank = s.shape[0] if found[1] == "A" else s.shape[-1]
            if rank > limit:
                raise LoraMismatch(
                    f"adapter: expected a rank of at most {limit} (vLLM's max_lora_rank), got "
                    f"rank {rank} (`{s.name}` {s.describe()})"
                )
            parts.setdefault(found[0], set()).add(found[1])
        half = next((m for m, p in parts.items() if p != {"A", "B"}), None)
        if half is not None:
            raise LoraMismatch(f"adapter: `{half}`: expected its lora_A and lora_B, got one")

    def take(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Keep a copy of the bucket's adapter tensors (its buffer is reused); the others."""
        rest = []
        for name, t in items:
            if is_adapter_name(name):
                self._pending[name] = t.detach().to("cpu", copy=True)
            else:
                rest.append((name, t))
        return rest

    def commit(self) -> None:
        """The push committed: its adapter, if it brought one, replaces the one served."""
        tensors, self._pending = self._pending, {}
        if not tensors:
            return
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self._manager()
        rank, _, scaling = (float(x) for x in tensors.pop(CONFIG_NAME).tolist())
        modules = sorted({m[0].rsplit(".", 1)[-1] for n in tensors if (m := adapter_module(n))})
        # vLLM scales by lora_alpha / r: an alpha that gives the pushed scaling
        helper = PEFTHelper.from_dict(
            {"r": int(rank), "lora_alpha": scaling * rank, "target_modules": modules}
        )
        helper.validate_legal(manager.lora_config)
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=ADAPTER_ID, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(self.model, "lora_skip_prefixes", None),
        )  # fmt: skip
        self.lora = lora
        self.install()

    @property
    def served(self) -> bool:
        return self.lora is not None

    def install(self) -> None:
        """(Re)place the adapter pushed last in vLLM's LoRA manager: vLLM drops every
        adapter when a weight update finishes (``reset_lora_state``)."""
        manager = self._manager()
        if self.lora is None or manager is None:
            return
        manager.remove_adapter(ADAPTER_ID)
        manager.add_adapter(self.lora)
        manager.activate_adapter(ADAPTER_ID)

    def drop(self) -> None:
        """The push failed: the adapter it brought in part is dropped (the served one stays)."""
        self._pending = {}


def _expected_modules(manager: Any) -> set[str]:
    """The module names an adapter may target in vLLM's model (as ``_load_adapter`` reads
    them: a packed module stands for its parts, ``qkv_proj`` for q, k and v)."""
    out: set[str] = set()
    for module in manager.supported_lora_modules:
        out.update(manager.packed_modules_mapping.get(module, [module]))
    return out
