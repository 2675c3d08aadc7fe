"""``QueueConfig``: what a queue is, checked once, shared by every way of starting one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlferry.wire.lowlevel import check_address, check_bind, curve_keys

from ._errors import SchemaError

__all__ = ["QueueConfig"]


@dataclass(frozen=True, kw_only=True)
class QueueConfig:
    """A queue's settings, the same for ``Queue(...)``, ``rlferry serve queue`` and the
    controller. Checked on construction: a bad value raises :class:`SchemaError` (or
    :class:`~rlferry.wire.SecurityError` for the bind and secret) naming the field,
    before anything starts.

    ``storage_units``: services that hold the payload. ``tasks``: the consumers that
    each read every sample once (``("actor_train", "critic_train")``). ``capacity``:
    samples held at most; ``max_partitions``: unfinished partitions at most; a put over
    either waits for room (None: no limit). ``lease_timeout``: seconds a got batch
    stays leased without an ack before it is delivered again. ``bind``: the
    controller's address (None: a fresh ipc:// path; ``tcp://127.0.0.1:*`` for a free
    loopback port; storage units bind beside it); a bind off loopback needs
    ``secret`` (16 bytes or more, the same on every client).
    """

    storage_units: int = 2
    tasks: tuple[str, ...] = ("train",)
    capacity: int | None = None
    max_partitions: int | None = None
    lease_timeout: float = 60.0
    bind: str | None = None
    secret: str | bytes | None = None

    def __post_init__(self) -> None:
        units = self.storage_units
        if type(units) is not int or units < 1:
            raise SchemaError(f"storage_units: expected an int >= 1, got {units!r}")
        tasks = self.tasks
        if (
            not isinstance(tasks, (tuple, list))
            or not tasks
            or not all(isinstance(t, str) and t for t in tasks)
            or len(set(tasks)) != len(tasks)
        ):
            raise SchemaError(
                f"tasks: expected distinct non-empty task names, got {tasks!r} "
                "(e.g. ('actor_train', 'critic_train'))"
            )
        object.__setattr__(self, "tasks", tuple(tasks))
        for name in ("capacity", "max_partitions"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise SchemaError(f"{name}: expected None or an int >= 1, got {value!r}")
        lease = self.lease_timeout
        if type(lease) not in (int, float) or not lease > 0:
            raise SchemaError(f"lease_timeout: expected seconds > 0, got {lease!r}")
        if self.bind is not None:
            try:
                check_address(self.bind)
            except ValueError as e:
                raise SchemaError(f"bind: {str(e).removeprefix('address: ')}") from None
            if self.bind.startswith("inproc://"):
                raise SchemaError(
                    f"bind: expected tcp://HOST:PORT or ipc://PATH, got {self.bind!r} "
                    "(storage units and clients may live in other processes)"
                )
            check_bind(self.bind, self.secret)
        if self.secret is not None:
            _check_secret(self.secret)

    def unit_bind(self) -> str | None:
        """Where a storage unit binds: beside a tcp:// controller (any port), else a fresh
        ipc:// path (None)."""
        if self.bind is not None and self.bind.startswith("tcp://"):
            return self.bind.rsplit(":", 1)[0] + ":*"
        return None


def _check_secret(secret: Any) -> None:
    if not isinstance(secret, (str, bytes)):
        raise SchemaError(f"secret: expected str or bytes, got {type(secret).__name__}")
    curve_keys(secret)  # raises SecurityError for a secret too short
