"""LoRA adapters: what one is on the wire, and how a model serves one in its forward.

An adapter is named tensors, as PEFT saves them: per target module (a linear layer of the
base model) ``base_model.model.<module>.lora_A.weight`` ``[rank, in]`` and
``base_model.model.<module>.lora_B.weight`` ``[out, rank]``, and its configuration in one
small tensor, :data:`CONFIG_NAME` (float32 ``[rank, alpha, scaling]``). The weight plane
moves them as it moves any named tensors (a ``WeightSender`` pushes them; a push of an
adapter commits a version like any push). An engine serves base + adapter:
``y = x W^T + scaling (x A^T) B^T``, the base weights untouched.

- :class:`LoraConfig`: the rank, alpha and target modules an engine serves
  (``HFEngine(..., lora=LoraConfig(rank=16, alpha=32))``).
- :class:`LoraLayers`: an adapter applied in a model's forward through hooks on its target
  linear layers, its tensors at fixed addresses (an update is a ``copy_`` into them, so a
  captured CUDA graph reads the new adapter); trainable for rlferry's own training.
- :func:`peft_adapter`: a ``peft`` model's adapter as the named tensors to push.
- :class:`LoraMismatch`: an adapter push that does not fit the engine's slots, refused
  before any byte moves.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlferry.errors import RequestError
from rlferry.weights import WeightSyncError
from rlferry.weights.planning import TensorSpec

__all__ = [
    "CONFIG_NAME",
    "PREFIX",
    "TARGETS",
    "LoraConfig",
    "LoraLayers",
    "LoraMismatch",
    "adapter_module",
    "config_tensor",
    "is_adapter_name",
    "lora_names",
    "peft_adapter",
]

PREFIX = "base_model.model."
"""What PEFT puts before a module's name in the tensors of an adapter it saves."""
CONFIG_NAME = "rlferry.lora_config"
"""The adapter's configuration, pushed with it: float32 ``[rank, alpha, scaling]``."""
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of the attention and the MLP of Llama-, Mistral- and Qwen-family
models: the default target modules."""
_A, _B = ".lora_A.weight", ".lora_B.weight"


class LoraMismatch(WeightSyncError, RequestError):
    """An adapter push that does not fit the engine's adapter slots (modules the engine
    lacks, another rank, a shape or dtype that does not fit, a part missing): refused when
    the receiver checks the push's layout, before any byte moves; the engine keeps serving
    its version. Also a ``ValueError``: the pusher's fault."""


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """The adapter an engine serves: ``rank``, ``alpha`` (the scaling is ``alpha / rank``
    unless a push says otherwise), ``target_modules`` (names matched as PEFT matches them:
    a module whose name is one of them or ends with ``.`` and one of them; linear layers
    only) and ``dtype`` of the adapter's tensors (None: the model's)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = TARGETS
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if type(self.rank) is not int or self.rank < 1:
            raise RequestError(f"LoraConfig.rank: expected an int >= 1, got {self.rank!r}")
        if (
            not isinstance(self.alpha, (int, float))
            or isinstance(self.alpha, bool)
            or not (math.isfinite(self.alpha) and self.alpha > 0)
        ):
            raise RequestError(f"LoraConfig.alpha: expected a number > 0, got {self.alpha!r}")
        targets = self.target_modules
        if (
            isinstance(targets, str)
            or not targets
            or not all(isinstance(t, str) and t for t in targets)
        ):
            raise RequestError(
                f"LoraConfig.target_modules: expected a non-empty sequence of module names, "
                f"got {targets!r}"
            )
        object.__setattr__(self, "target_modules", tuple(targets))
        if self.dtype is not None and not (
            isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        ):
            raise RequestError(
                f"LoraConfig.dtype: expected None or a float torch.dtype, got {self.dtype!r}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_names(module: str) -> tuple[str, str]:
    """The names of ``module``'s A and B, as PEFT saves them."""
    return f"{PREFIX}{module}{_A}", f"{PREFIX}{module}{_B}"


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is a tensor of an adapter (PEFT's namespace, or the config)."""
    return name == CONFIG_NAME or name.startswith(PREFIX)


def adapter_module(name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` of an adapter tensor's name; None for any other name."""
    for end, part in ((_A, "A"), (_B, "B")):
        if name.startswith(PREFIX) and name.endswith(end):
            return name[len(PREFIX) : -len(end)], part
    return None


def config_tensor(rank: int, alpha: float, scaling: float | None = None) -> torch.Tensor:
    """The :data:`CONFIG_NAME` tensor of an adapter (``scaling``: ``alpha / rank`` unless
    given, say ``alpha / sqrt(rank)`` for rsLoRA)."""
    s = alpha / rank if scaling is None else scaling
    return torch.tensor([float(rank), float(alpha), float(s)], dtype=torch.float32)


def target_linears(model: nn.Module, targets: Sequence[str]) -> list[tuple[str, nn.Linear]]:
    """The linear layers of ``model`` that ``targets`` name (PEFT's rule), in module order."""
    found = []
    for name, module in model.named_modules():
        if any(name == t or name.endswith("." + t) for t in targets):
            if not isinstance(module, nn.Linear):
                raise RequestError(
                    f"LoraConfig.target_modules: `{name}` is a {type(module).__name__}, "
                    "expected linear layers only (nn.Linear)"
                )
            found.append((name, module))
    if not found:
        raise RequestError(
            f"LoraConfig.target_modules: expected names of the model's linear layers, got "
            f"{list(targets)}, which name none of its modules"
        )
    return found


class LoraLayers:
    """An adapter of ``config`` applied in ``model``'s forward: a hook on each target linear
    layer adds ``scaling (x A^T) B^T`` to its output, computed in the adapter's dtype then
    added as PEFT adds it. A and B are made once, at the adapter's rank (A zero, B zero:
    the base model's output until an adapter is loaded), and stay where they are: loading
    one is a ``copy_`` into :meth:`tensors` (a captured CUDA graph reads it). The base
    weights and the model's ``state_dict`` are untouched.

    ``trainable``: A and B are ``nn.Parameter`` with gradients (:meth:`parameters`), for
    training the adapter (initialize A first: PEFT draws it Kaiming-uniform).
    :meth:`remove` takes the hooks off."""

    def __init__(
        self, model: nn.Module, config: LoraConfig, *, device: Any = None,
        trainable: bool = False,
    ) -> None:  # fmt: skip
        self.config = config
        targets = target_linears(model, config.target_modules)
        first = next(model.parameters())
        device = torch.device(device) if device is not None else first.device
        dtype = config.dtype or first.dtype
        r = config.rank
        self.modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._hooks = []
        for name, linear in targets:
            a = torch.zeros((r, linear.in_features), dtype=dtype, device=device)
            b = torch.zeros((linear.out_features, r), dtype=dtype, device=device)
            if trainable:
                a, b = nn.Parameter(a), nn.Parameter(b)
            self.modules[name] = (a, b)
            na, nb = lora_names(name)
            self._tensors[na], self._tensors[nb] = a, b
        self.config_tensor = config_tensor(r, config.alpha).to(device)
        self._tensors[CONFIG_NAME] = self.config_tensor
        scale = self.config_tensor[2]  # a view: a loaded config changes it in place
        for name, linear in targets:
            a, b = self.modules[name]
            self._hooks.append(linear.register_forward_hook(_hook(a, b, scale)))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors by their PEFT names (by module, A then B), then the config:
        the engine's own, where a push loads."""
        return dict(self._tensors)

    def named(self, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
        """The adapter to push (detached; A and B cast to ``dtype`` when given)."""
        out = []
        for name, t in self._tensors.items():
            t = t.detach()
            if dtype is not None and name != CONFIG_NAME:
                t = t.to(dtype)
            out.append((name, t))
        return out

    def parameters(self) -> list[torch.Tensor]:
        """A and B of every module, in order (an optimizer's, when trainable)."""
        return [t for pair in self.modules.values() for t in pair]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def check(self, specs: Iterable[TensorSpec]) -> set[str] | None:
        """The modules a push of ``specs`` carries the adapter of (None: no adapter tensor),
        or :class:`LoraMismatch` saying why it does not fit these slots."""
        r = self.config.rank
        got: dict[str, dict[str, TensorSpec]] = {}
        config: TensorSpec | None = None
        bad: list[str] = []
        lacks: list[str] = []
        for s in specs:
            if s.name == CONFIG_NAME:
                config = s
                continue
            if not is_adapter_name(s.name):
                continue
            found = adapter_module(s.name)
            if found is None:
                bad.append(f"`{s.name}`: not a LoRA A or B weight (served: linear layers' A, B)")
            elif found[0] not in self.modules:
                if found[0] not in lacks:
                    lacks.append(found[0])
            else:
                got.setdefault(found[0], {})[found[1]] = s
        if lacks:
            more = f" and {len(lacks) - 3} more" if len(lacks) > 3 else ""
            raise LoraMismatch(
                f"adapter: expected modules of the engine's adapter slots (target_modules "
                f"{list(self.config.target_modules)}), got {len(lacks)} it lacks: "
                f"{', '.join(f'`{m}`' for m in lacks[:3])}{more} (start the engine with "
                "LoraConfig(target_modules=...) naming them)"
            )
        if not got and config is None and not bad:
            return None
        for module, parts in got.items():
            a, b = self.modules[module]
            for part, want in (("A", a), ("B", b)):
                p = parts.get(part)
                if p is None:
                    bad.append(f"`{module}`: its lora_{part} is missing (push A and B together)")
                    continue
                rank = p.shape[0] if part == "A" else p.shape[-1]
                if len(p.shape) == 2 and rank != r:
                    raise LoraMismatch(
                        f"adapter: expected rank {r} (the engine's adapter slots), got rank "
                        f"{rank} (`{p.name}` {p.describe()}); start the engine with "
                        f"LoraConfig(rank={rank}) to serve it"
                    )
                if p.shape != tuple(want.shape) or p.dtype != want.dtype:
                    ws = TensorSpec(p.name, tuple(want.shape), want.dtype)
                    bad.append(f"`{p.name}`: expected {ws.describe()}, got {p.describe()}")
        if config is None:
            bad.append(f"`{CONFIG_NAME}`: missing (an adapter travels with its rank and alpha)")
        elif config.shape != (3,) or config.dtype != torch.float32:
            bad.append(f"`{CONFIG_NAME}`: expected float32 [3], got {config.describe()}")
        elif not got:
            bad.append(f"`{CONFIG_NAME}`: pushed without any A or B")
        if bad:
            more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise LoraMismatch(
                f"adapter: {len(bad)} of its tensors do not fit the engine's adapter slots "
                f"(rank {r}): " + "; ".join(bad[:3]) + more
            )
        return set(got)

    def clear(self, keep: set[str]) -> None:
        """Zero A and B of every module but ``keep`` (those a push left out: an adapter is
        served whole, the modules it does not name without an adapter)."""
        with torch.no_grad():
            for module, (a, b) in self.modules.items():
                if module not in keep:
                    a.zero_()
                    b.zero_()

    def remove(self) -> None:
        """Take the hooks off: the model computes its base output again."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _hook(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> Any:
    def add_adapter(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        lora = nn.functional.linear(nn.functional.linear(x.to(a.dtype), a), b) * scale.to(a.dtype)
        return (out + lora).to(out.dtype)

    return add_adapter


def peft_adapter(
    model: Any, adapter: str = "default", dtype: torch.dtype | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The named tensors to push for ``model``'s (a ``peft`` ``PeftModel``) adapter
    ``adapter``: its A and B as ``peft.get_peft_model_state_dict`` names them (cast to
    ``dtype`` when given), then :data:`CONFIG_NAME` (rank, alpha and PEFT's scaling:
    ``alpha / sqrt(rank)`` with rsLoRA). An adapter of per-module ranks or alphas
    (``rank_pattern``, ``alpha_pattern``) is refused: an engine's slots have one rank."""
    try:
        from peft import get_peft_model_state_dict
    except ImportError:
        raise ImportError("peft_adapter needs peft: pip install 'rlferry[lora]'") from None
    cfg = model.peft_config[adapter]
    if getattr(cfg, "rank_pattern", None) or getattr(cfg, "alpha_pattern", None):
        raise LoraMismatch(
            "adapter: expected one rank and alpha for every module, got rank_pattern or "
            "alpha_pattern (an engine's adapter slots have one rank)"
        )
    rank, alpha = int(cfg.r), float(cfg.lora_alpha)
    scaling = alpha / math.sqrt(rank) if getattr(cfg, "use_rslora", False) else alpha / rank
    state = get_peft_model_state_dict(model, adapter_name=adapter)
    out = []
    for name, t in state.items():
        if adapter_module(name) is None:
            raise LoraMismatch(
                f"adapter: `{name}`: not a LoRA A or B weight (served: linear layers' A, B)"
            )
        t = t.detach()
        out.append((name, t.to(dtype) if dtype is not None else t))
    return [*out, (CONFIG_NAME, config_tensor(rank, alpha, scaling))]
