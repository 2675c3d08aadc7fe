"""The request dispatch shared by the queue's services: ``[op, args]`` to ``ops[op](**args)``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ._errors import SchemaError

__all__ = ["dispatch"]


async def dispatch(ops: dict[str, Callable[..., Any]], value: Any) -> Any:
    """Run the request's op with its args; an async op is awaited."""
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], dict)):
        raise SchemaError(f"request: expected [op, args], got {value!r:.60}")
    op, args = value
    fn = ops.get(op)
    if fn is None:
        raise SchemaError(f"op: expected one of {sorted(ops)}, got {op!r}")
    result = fn(**args)
    return await result if asyncio.iscoroutine(result) else result
