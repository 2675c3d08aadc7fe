"""A client's links to the queue's services: the controller, and each storage unit once
a request needs it; a request's failure becomes the queue's error for it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from rlferry.wire import (
    AsyncClient,
    ChannelClosed,
    PeerGone,
    RemoteError,
    RequestTimeout,
    SecurityError,
    WireError,
)
from rlferry.wire.lowlevel import CONNECT_TIMEOUT, AsyncResource

from ._checks import checked_address
from ._errors import ERRORS, QueueClosed, SchemaError, ServiceGone
from ._messages import Info, to_wire

__all__ = ["CONTROL_TIMEOUT", "Links"]

CONTROL_TIMEOUT = 30.0  # requests that never wait on other clients (a dead peer: at once)


class Links(AsyncResource):
    """The links of one client (see :class:`~._client.AsyncQueueClient` for ``dial`` and
    ``why_gone``). ``await aclose()`` closes them; a request after that raises
    :class:`QueueClosed`."""

    def __init__(
        self,
        address: str,
        *,
        secret: str | bytes | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        dial: Callable[[str], str] | None = None,
        why_gone: Callable[[str, str], Awaitable[str]] | None = None,
    ) -> None:
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._dial = dial
        self._why_gone = why_gone
        self._known: dict[str, str] = {}  # dialed address -> the address the service is known by
        self.controller = self._client_of(checked_address(address))
        self._units: list[AsyncClient] = []
        self._closed = False

    def _client_of(self, address: str) -> AsyncClient:
        dialed = self._dial(address) if self._dial is not None else address
        self._known[dialed] = address
        return AsyncClient(dialed, secret=self._secret, connect_timeout=self._connect_timeout)

    async def ask(self, msg: Any, timeout: float | None) -> Any:
        """The controller's answer to ``msg``."""
        return await self.call(self.controller, msg, timeout)

    async def call(self, client: AsyncClient, msg: Any, timeout: float | None) -> Any:
        """The answer of the service ``client`` links to; its failure as a queue error."""
        if self._closed:
            raise QueueClosed("this queue client is closed")
        try:
            return await client.request(to_wire(msg), timeout)
        except RemoteError as e:
            known = ERRORS.get(e.kind)
            if known is None:
                raise RemoteError(e.kind, f"{e.message} (at {client.address})") from None
            raise known(e.message) from None
        except SecurityError:
            raise
        except PeerGone as e:
            message = str(e)
            if self._why_gone is not None:
                message = await self._why_gone(self._known[client.address], message)
            raise ServiceGone(message) from None
        except RequestTimeout:
            raise ServiceGone(
                f"{client.address} did not answer within {timeout} s (is it running?)"
            ) from None
        except ChannelClosed:
            raise QueueClosed("this queue client is closed") from None
        except WireError as e:  # put checked its values before: this is a bug, say so whole
            raise SchemaError(f"request `{msg.__struct_config__.tag}`: {e}") from None

    async def unit(self, unit: int) -> AsyncClient:
        """The link to storage unit ``unit`` (the controller names the units)."""
        if unit >= len(self._units):
            info = await self.ask(Info(), CONTROL_TIMEOUT)
            for address in info["units"][len(self._units) :]:
                self._units.append(self._client_of(address))
        return self._units[unit]

    async def aclose(self) -> None:
        """Close every link; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for c in [self.controller, *self._units]:
            await c.aclose()
