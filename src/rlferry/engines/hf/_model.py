"""Loading the model an :class:`~rlferry.engines.hf.HFEngine` serves; checking the pushes
and the requests it gets against it."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlferry.control import GenerateRequest
from rlferry.errors import RequestError
from rlferry.weights import WeightSyncError

__all__ = [
    "Loaded",
    "NonFinite",
    "cache_kw",
    "check_finite",
    "check_options",
    "check_request",
    "load_model",
    "transformers",
]


def transformers() -> Any:
    """The ``transformers`` module, or an ImportError naming the extra that brings it."""
    try:
        import transformers as tf
    except ImportError:
        raise ImportError(
            "rlferry.engines.hf needs transformers: pip install 'rlferry[hf]'"
        ) from None
    return tf


@dataclass(frozen=True)
class Loaded:
    model: torch.nn.Module
    device: torch.device
    vocab_size: int
    max_len: int | None
    new_cache: Callable[[], Any]
    sliding: bool  # some layers attend through a sliding window


def load_model(model: Any, device: Any, dtype: torch.dtype | None) -> Loaded:
    """``model`` (a causal LM or a local directory) on ``device`` in ``dtype``, in eval mode."""
    tf = transformers()
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise RequestError(
                f"HFEngine.device: expected a torch device such as 'cuda:0' or 'cpu', "
                f"got {device!r}"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RequestError(
                f"HFEngine.device: expected a device this torch can use, got {str(device)!r} "
                "(torch.cuda.is_available() is False)"
            )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise RequestError(f"HFEngine.dtype: expected None or a torch.dtype, got {dtype!r}")
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise RequestError(
                f"HFEngine.model: expected a transformers causal LM or a local directory, "
                f"got {path!r}, which is not a directory (nothing is downloaded)"
            )
        model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    if not isinstance(model, tf.PreTrainedModel) or not model.can_generate():
        raise RequestError(
            f"HFEngine.model: expected a transformers causal LM or a local directory, "
            f"got {type(model).__name__}"
        )
    first = next(model.parameters(), None)
    device = device or (first.device if first is not None else torch.device("cpu"))
    if first is not None and (first.device != device or (dtype and first.dtype != dtype)):
        model = model.to(device=device, dtype=dtype)
        device = next(model.parameters()).device  # "cuda" -> "cuda:0"
    model.eval()
    text = model.config.get_text_config()
    return Loaded(
        model=model,
        device=device,
        vocab_size=int(text.vocab_size),
        max_len=getattr(text, "max_position_embeddings", None),
        new_cache=tf.DynamicCache,
        sliding=any(getattr(tf.DynamicCache(config=model.config), "is_sliding", [])),
    )


class NonFinite(WeightSyncError, RequestError):
    """A pushed tensor holds NaN or Inf: the pusher's fault (also a ``ValueError``)."""


def check_finite(items: list[tuple[str, torch.Tensor]]) -> None:
    """Raise :class:`NonFinite` naming the first float tensor of ``items`` with a NaN or
    an Inf (one read of each, one device sync in all)."""
    floats = [(n, t) for n, t in items if t.is_floating_point() and t.numel()]
    if not floats:
        return
    ok = torch.stack([torch.isfinite(t).all() for _, t in floats]).tolist()
    bad = next((n for (n, _), fine in zip(floats, ok, strict=True) if not fine), None)
    if bad is not None:
        raise NonFinite(
            f"tensor `{bad}`: expected finite values, got NaN or Inf (check_finite; did "
            "the trainer diverge?)"
        )


def check_options(
    *, max_batch: Any, max_prefill_tokens: Any, version: Any, max_model_len: Any, name: Any,
    check_finite: Any, kv_cache: Any,
) -> None:  # fmt: skip
    """Refuse an ``HFEngine`` option of the wrong type or range, naming it."""
    for field, value, low in (
        ("max_batch", max_batch, 1), ("max_prefill_tokens", max_prefill_tokens, 1),
        ("version", version, 0),
    ):  # fmt: skip
        if type(value) is not int or value < low:
            raise RequestError(f"HFEngine.{field}: expected an int >= {low}, got {value!r}")
    if max_model_len is not None and (type(max_model_len) is not int or max_model_len < 2):
        raise RequestError(
            f"HFEngine.max_model_len: expected None or an int >= 2, got {max_model_len!r}"
        )
    if name is not None and (not isinstance(name, str) or not name):
        raise RequestError(f"HFEngine.name: expected a non-empty str, got {name!r}")
    if not isinstance(check_finite, bool):
        raise RequestError(f"HFEngine.check_finite: expected a bool, got {check_finite!r}")
    if kv_cache not in (None, "dynamic", "slots"):
        raise RequestError(
            f"HFEngine.kv_cache: expected None, 'dynamic' or 'slots', got {kv_cache!r}"
        )


def cache_kw(model: torch.nn.Module) -> str:
    """The name ``model.forward`` takes its KV cache by (``cache`` from transformers 5.24 on,
    ``past_key_values`` before: deprecated since)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def check_request(request: Any, vocab_size: int, max_model_len: int | None, engine: str) -> None:
    """Refuse a request the model cannot run (a token id outside ``vocab_size``, prompt +
    ``max_tokens`` beyond ``max_model_len``), naming ``engine``."""
    if not isinstance(request, GenerateRequest):
        raise TypeError(f"generate: expected a GenerateRequest, got {type(request).__name__}")
    rid, prompt = request.request_id, request.prompt_ids
    bad = next((i for i, t in enumerate(prompt) if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"request `{rid}`: prompt_ids[{bad}]: expected a token id below "
            f"{vocab_size} (the model's vocab_size), got {prompt[bad]}",
            engine,
        )
    n = len(prompt) + request.params.max_tokens
    if max_model_len is not None and n > max_model_len:
        raise RequestError(
            f"request `{rid}`: expected prompt + max_tokens <= {max_model_len} (the "
            f"engine's max_model_len), got {len(prompt)} + {request.params.max_tokens} "
            f"= {n} (shorten the prompt or lower max_tokens)",
            engine,
        )
