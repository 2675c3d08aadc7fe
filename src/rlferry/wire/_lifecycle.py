"""The end of an async resource's life, written once: ``aclose()``, ``async with``, and
the old ``close()`` name.

A resource used from asyncio (a server, a client, a service) subclasses
:class:`AsyncResource` and implements an idempotent :meth:`~AsyncResource.aclose`;
``async with`` closes it on exit. Its former async ``close()`` stays one release as a
deprecated alias: ``await x.close()`` warns, then closes.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["AsyncResource"]

R = TypeVar("R", bound="AsyncResource")


class AsyncResource(abc.ABC):
    """An async resource: ``await aclose()`` (a second call does nothing), ``async with``."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release everything the resource holds; a second call does nothing."""

    async def __aenter__(self: R) -> R:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def close(self) -> Coroutine[Any, Any, None]:
        """Deprecated: ``await x.aclose()``."""
        name = type(self).__name__
        warnings.warn(
            f"{name}.close() is deprecated: use `await {name}.aclose()`",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.aclose()
