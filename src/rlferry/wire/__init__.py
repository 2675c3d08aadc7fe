"""The wire: a zero-copy codec (msgpack header + raw tensor frames) and zmq sockets.

Every plane of rlferry speaks through this package. Nothing is pickled.
"""

from ._address import default_address, is_local
from ._clients import AsyncClient
from ._codec import encode
from ._decode import decode
from ._errors import (
    ChannelClosed,
    FileFormatError,
    PeerGone,
    RemoteError,
    RequestTimeout,
    SecurityError,
    WireError,
)
from ._loop import wire_loop
from ._refs import TensorRef
from ._server import Server
from ._sync_client import Client
from .columns import PackedStrings, RaggedRows, pack_strings
from .memory._segments import shared_copies, shared_empty

__all__ = [
    "AsyncClient",
    "ChannelClosed",
    "Client",
    "FileFormatError",
    "PackedStrings",
    "PeerGone",
    "RaggedRows",
    "RemoteError",
    "RequestTimeout",
    "SecurityError",
    "Server",
    "TensorRef",
    "WireError",
    "decode",
    "default_address",
    "encode",
    "is_local",
    "pack_strings",
    "shared_copies",
    "shared_empty",
    "wire_loop",
]
