"""The sender's and the receiver's configuration: keyword-only, validated on construction."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlferry.errors import RequestError

from .planning._buckets import ALIGN

__all__ = ["TRANSPORTS", "ReceiverConfig", "SenderConfig"]

TRANSPORTS = ("shm", "cuda_ipc", "broadcast")
MIN_BUCKET = 4096


def _check_group(owner: str, group: Any) -> None:
    if not isinstance(group, str) or not group:
        raise RequestError(f"{owner}.group: expected a non-empty str, got {group!r}")


def _check_device(owner: str, device: Any) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise RequestError(
            f"{owner}.device: expected a torch device such as 'cuda:0' or 'cpu', got {device!r}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class SenderConfig:
    """What a :class:`~rlferry.weights.WeightSender` is: see its docstring."""

    group: str
    transport: str = "shm"
    receivers: int = 1
    bucket_bytes: int | None = None
    bind: str | None = None
    device: Any = None
    secret: str | bytes | None = None
    zero_copy: bool = True
    grouped_pack: bool = True
    nccl_high_priority: bool = True
    delta_budget: int = 0
    delta_base: str = "device"
    delta_policy: str = "measured"

    def __post_init__(self) -> None:
        _check_group("WeightSender", self.group)
        if type(self.delta_budget) is not int or self.delta_budget < 0:
            raise RequestError(
                f"WeightSender.delta_budget: expected an int >= 0 (bytes of the last version "
                f"kept for delta pushes; 0: off), got {self.delta_budget!r}"
            )
        if self.delta_base not in ("device", "host"):
            raise RequestError(
                f"WeightSender.delta_base: expected 'device' or 'host', got {self.delta_base!r}"
            )
        if self.delta_policy not in ("measured", "always"):
            raise RequestError(
                f"WeightSender.delta_policy: expected 'measured' or 'always', got "
                f"{self.delta_policy!r}"
            )
        for flag in ("zero_copy", "grouped_pack", "nccl_high_priority"):
            if not isinstance(getattr(self, flag), bool):
                raise RequestError(
                    f"WeightSender.{flag}: expected a bool, got {getattr(self, flag)!r}"
                )
        if self.transport not in TRANSPORTS:
            raise RequestError(
                f"WeightSender.transport: expected one of 'shm', 'cuda_ipc', 'broadcast', "
                f"got {self.transport!r}"
            )
        if type(self.receivers) is not int or self.receivers < 1:
            raise RequestError(
                f"WeightSender.receivers: expected an int >= 1, got {self.receivers!r}"
            )
        b = self.bucket_bytes
        if b is not None and (type(b) is not int or b < MIN_BUCKET):
            raise RequestError(
                f"WeightSender.bucket_bytes: expected an int >= {MIN_BUCKET} "
                f"(or None: chosen from free memory), got {b!r}"
            )
        if b is not None:
            object.__setattr__(self, "bucket_bytes", b - b % ALIGN)
        if self.bind is not None and not (
            isinstance(self.bind, str) and self.bind.split("://")[0] in ("tcp", "ipc")
        ):
            raise RequestError(
                f"WeightSender.bind: expected tcp://HOST:PORT or ipc://PATH, got {self.bind!r}"
            )
        object.__setattr__(self, "device", _check_device("WeightSender", self.device))
        if self.transport == "cuda_ipc" and self.device is not None and self.device.type != "cuda":
            raise RequestError(
                f"WeightSender.device: expected a CUDA device for transport 'cuda_ipc', "
                f"got {str(self.device)!r}"
            )


@dataclass(frozen=True, kw_only=True)
class ReceiverConfig:
    """What a :class:`~rlferry.weights.WeightReceiver` is: see its docstring."""

    group: str
    address: str
    load: Callable[[list[tuple[str, torch.Tensor]]], Any]
    device: Any = None
    on_commit: Callable[[int], Any] | None = None
    on_failure: Callable[[str, bool], Any] | None = None
    expected: Mapping[str, Any] | Callable[[list[Any]], None] | None = None
    verify: bool = False
    name: str | None = None
    secret: str | bytes | None = None
    deltas: str | None = None
    delta_base: str = "host"

    def __post_init__(self) -> None:
        _check_group("WeightReceiver", self.group)
        if self.deltas not in (None, "in_place", "base", "whole"):
            raise RequestError(
                f"WeightReceiver.deltas: expected None, 'in_place', 'base' or 'whole', got "
                f"{self.deltas!r}"
            )
        if self.delta_base not in ("device", "host"):
            raise RequestError(
                f"WeightReceiver.delta_base: expected 'device' or 'host', got {self.delta_base!r}"
            )
        if not isinstance(self.address, str) or "://" not in self.address:
            raise RequestError(
                f"WeightReceiver.address: expected the sender's address "
                f"(tcp://HOST:PORT or ipc://PATH, from sender.address), got {self.address!r}"
            )
        if not callable(self.load):
            raise RequestError(
                f"WeightReceiver.load: expected a callable taking a list of (name, tensor), "
                f"got {type(self.load).__name__}"
            )
        if self.on_commit is not None and not callable(self.on_commit):
            raise RequestError(
                f"WeightReceiver.on_commit: expected a callable taking the version, "
                f"got {type(self.on_commit).__name__}"
            )
        if self.on_failure is not None and not callable(self.on_failure):
            raise RequestError(
                f"WeightReceiver.on_failure: expected a callable taking (reason, final), "
                f"got {type(self.on_failure).__name__}"
            )
        e = self.expected
        if e is not None and not (callable(e) or isinstance(e, Mapping)):
            raise RequestError(
                f"WeightReceiver.expected: expected a mapping of name to tensor or a callable, "
                f"got {type(e).__name__}"
            )
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise RequestError(f"WeightReceiver.name: expected a non-empty str, got {self.name!r}")
        object.__setattr__(self, "device", _check_device("WeightReceiver", self.device))
