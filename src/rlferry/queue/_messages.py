"""The queue's requests: tagged, frozen structs, one typed decoder per service.

A client builds a request, :func:`to_wire` turns it into a plain dict (``op`` names
it) that the wire codec carries, and the service turns it back with its decoder,
which checks every field (type, range, and the fields that must agree) before the
service acts on it. A request that does not fit raises :class:`SchemaError`
naming the field: a raw client cannot wind the index counter back with
``rows=-3`` or reserve samples with a meta it cannot store.

The controller's requests hold plain values only (its server decodes with
``tensors=False``); a storage unit's ``put`` and ``load`` carry columns.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar, Union

import msgspec
from msgspec import Meta

from rlferry.errors import RequestError
from rlferry.wire.lowlevel import brief

from ._errors import SchemaError
from ._samplers import Sampler, Sequential

__all__ = [
    "Ack",
    "Alloc",
    "Clear",
    "Drop",
    "Dump",
    "Fields",
    "Get",
    "Info",
    "Load",
    "Produced",
    "Put",
    "Read",
    "Release",
    "Stats",
    "controller_request",
    "storage_request",
    "to_wire",
]

Name = Annotated[str, Meta(min_length=1)]
Index = Annotated[int, Meta(ge=0)]
Count = Annotated[int, Meta(ge=1)]
Seconds = Union[Annotated[float, Meta(ge=0)], None]  # noqa: UP007 (msgspec reads it at runtime)
Indexes = Annotated[list[Index], Meta(min_length=1)]
Fieldnames = Annotated[list[Name], Meta(min_length=1)]


class _Request(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True):
    pass


# -- the controller's --------------------------------------------------------------------
class Info(_Request, frozen=True, tag="info"):
    """Tasks and storage unit addresses."""


class Alloc(_Request, frozen=True, tag="alloc"):
    """Reserve ``rows`` new samples of ``partition`` (or name existing ones in ``indexes``)."""

    partition: Name
    rows: Count
    signatures: dict[Name, list[Any]]
    meta: dict[Name, list[Any]] = {}
    partition_meta: dict[Name, Any] | None = None
    indexes: list[Index] | None = None
    timeout: Seconds = None

    def __post_init__(self) -> None:
        for key, values in self.meta.items():
            if len(values) != self.rows:
                raise RequestError(
                    f"meta `{key}`: expected {self.rows} values (one per sample), got {len(values)}"
                )
        if self.indexes is not None and (
            len(self.indexes) != self.rows or len(set(self.indexes)) != self.rows
        ):
            raise RequestError(f"indexes: expected {self.rows} distinct indexes (one per row)")


class Produced(_Request, frozen=True, tag="produced"):
    """A storage unit stored ``fields`` of these samples."""

    partition: Name
    indexes: Indexes
    fields: Fieldnames


class Get(_Request, frozen=True, tag="get"):
    """Lease a share of ready samples (parked until there are enough, or ``timeout``)."""

    partition: Name
    task: Name
    fields: Fieldnames
    batch_size: Count
    dp_rank: Index = 0
    dp_size: Count = 1
    batch: Index = 0
    sampler: Sampler = Sequential()
    timeout: Seconds = None

    def __post_init__(self) -> None:
        if self.dp_rank >= self.dp_size:
            raise RequestError(
                f"dp_rank: expected an int in [0, {self.dp_size}), got {self.dp_rank}"
            )


class Ack(_Request, frozen=True, tag="ack"):
    """The samples of a lease were consumed by ``task``."""

    partition: Name
    task: Name
    lease: Index
    indexes: list[Index]


class Clear(_Request, frozen=True, tag="clear"):
    partition: Name


class Release(_Request, frozen=True, tag="release"):
    """A put whose data did not reach storage gives its new samples back."""

    partition: Name
    indexes: Indexes


class Fields(_Request, frozen=True, tag="fields"):
    """The fields a partition holds (to name them when a get waits for another)."""

    partition: Name


class Stats(_Request, frozen=True, tag="stats"):
    pass


class Dump(_Request, frozen=True, tag="dump"):
    pass


# -- a storage unit's -------------------------------------------------------------------
class Put(_Request, frozen=True, tag="put"):
    partition: Name
    indexes: Indexes
    columns: dict[Name, Any]


class Read(_Request, frozen=True, tag="read"):
    indexes: Indexes
    fields: Fieldnames


class Drop(_Request, frozen=True, tag="drop"):
    indexes: list[Index]


class Load(_Request, frozen=True, tag="load"):
    fields: dict[Name, Any]


ControllerRequest = Union[  # noqa: UP007
    Info, Alloc, Produced, Get, Ack, Clear, Release, Fields, Stats, Dump
]
StorageRequest = Union[Put, Read, Drop, Stats, Dump, Load]  # noqa: UP007

T = TypeVar("T")


def to_wire(msg: _Request) -> dict[str, Any]:
    """The plain dict the wire carries: ``op`` and the fields, values as they are
    (tensors stay tensors for the codec; a sampler becomes its tagged dict)."""
    out: dict[str, Any] = {"op": msg.__struct_config__.tag}
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        out[name] = msgspec.to_builtins(value) if isinstance(value, msgspec.Struct) else value
    return out


def _ops(kind: Any) -> list[str]:
    return sorted(t.__struct_config__.tag for t in kind.__args__)


_CONTROLLER_OPS = _ops(ControllerRequest)
_STORAGE_OPS = _ops(StorageRequest)


def _decode(value: Any, kind: Any, ops: list[str]) -> Any:
    if not isinstance(value, dict):
        raise SchemaError(
            f"request: expected a dict with `op`, got {type(value).__name__} "
            "(use rlferry's queue client)"
        )
    op = value.get("op")
    if op not in ops:
        raise SchemaError(f"request: op: expected one of {ops}, got {brief(op)}")
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as e:
        raise SchemaError(f"request `{op}`: {e}") from None


def controller_request(value: Any) -> ControllerRequest:
    """A controller request, every field checked.

    Raises:
        SchemaError: the value is not one, naming the field (``$.rows``) and what came.
    """
    return _decode(value, ControllerRequest, _CONTROLLER_OPS)


def storage_request(value: Any) -> StorageRequest:
    """A storage unit request, every field checked (columns are checked as they are stored)."""
    return _decode(value, StorageRequest, _STORAGE_OPS)
