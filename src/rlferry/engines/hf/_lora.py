"""How an :class:`~rlferry.engines.hf.HFEngine` serves a LoRA adapter: applied in its
forward (:class:`rlferry.engines.lora.LoraLayers`, made before the decode steps are
captured), each push checked against its adapter slots before any byte moves, an adapter
served whole once its push commits."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from rlferry.errors import RequestError
from rlferry.weights import WeightSyncError
from rlferry.weights.planning import TensorSpec

from ..lora import LoraConfig, LoraLayers, LoraMismatch, is_adapter_name

__all__ = ["ServedAdapter"]


class ServedAdapter:
    """The adapter slots of an engine's ``model`` (``config``'s rank and target modules, on
    ``device``): :meth:`check` is the receivers' plan check, :meth:`committed` runs before
    a version is served."""

    def __init__(self, model: torch.nn.Module, config: Any, device: torch.device) -> None:
        if not isinstance(config, LoraConfig):
            raise RequestError(
                f"HFEngine.lora: expected None or a rlferry.engines.lora.LoraConfig, got {config!r}"
            )
        self.layers = LoraLayers(model, config, device=device)
        self._covered: set[str] | None = None  # the modules the checked plan carries

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.layers.tensors()

    def check(self, base: Mapping[str, torch.Tensor]) -> Callable[[list[TensorSpec]], None]:
        """The plan check of a receiver: the adapter's tensors against the slots (a
        :class:`~rlferry.engines.lora.LoraMismatch` says why they do not fit), every other
        tensor against ``base`` (the model's), as a receiver checks a model's push."""

        def check(specs: list[TensorSpec]) -> None:
            covered = self.layers.check(specs)
            bad = []
            for s in specs:
                if is_adapter_name(s.name):
                    continue
                want = base.get(s.name)
                if want is None:
                    bad.append(f"`{s.name}`: not a parameter of the receiver, got {s.describe()}")
                elif tuple(want.shape) != s.shape or want.dtype != s.dtype:
                    ws = TensorSpec(s.name, tuple(want.shape), want.dtype)
                    bad.append(f"`{s.name}`: expected {ws.describe()}, got {s.describe()}")
            if bad:
                more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
                raise WeightSyncError(
                    f"{len(bad)} of {len(specs)} tensors differ from the receiver's "
                    "parameters: " + "; ".join(bad[:3]) + more
                )
            self._covered = covered

        return check

    def refuse_sharded(self, specs: Iterable[TensorSpec]) -> None:
        """Raise :class:`~rlferry.engines.lora.LoraMismatch` if ``specs`` (the layout of
        ``ShardedSender`` ranks) hold an adapter's tensors."""
        names = [s.name for s in specs if is_adapter_name(s.name)]
        if names:
            raise LoraMismatch(
                f"adapter: expected it from a WeightSender, got `{names[0]}` in the layout of "
                "ShardedSender ranks (an adapter is small: push it whole from one rank)"
            )

    def committed(self) -> None:
        """A push committed: if it carried an adapter, the modules it left out serve no
        adapter (the adapter is served whole, as pushed)."""
        if self._covered is not None:
            self.layers.clear(self._covered)
