"""Where the TransferQueue API's state lives, and how a client reaches it.

``Backend`` is the seam: a controller and a store, in this process (``embedded``) or held by
a service in another (``remote``: ``RemoteController`` and ``RemoteStore``, one request per
call over rlferry's wire to ``serve``'s service). On Ray the service is a named actor of the
job (``_ray``, imported only when Ray is used).
"""

from ._backend import Backend, Connection, Factory, Part, embedded, remote
from ._remote import RemoteController
from ._service import Service, serve

__all__ = [
    "Backend",
    "Connection",
    "Factory",
    "Part",
    "RemoteController",
    "Service",
    "embedded",
    "remote",
    "serve",
]
