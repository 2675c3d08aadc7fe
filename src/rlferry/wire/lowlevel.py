"""What the planes built on the wire use beyond its public API.

The queue, the weight plane and the TransferQueue shim move bytes with the wire's own
copies, check addresses and secrets the wire's way, share memory through its registry and
close like its resources. These are those parts, in one place: a plane imports them from
here, never from the wire's private modules. Users need none of them.
"""

from ._address import check_address, check_bind, curve_keys
from ._clients import CONNECT_TIMEOUT
from ._codec import tensor_buffer, tensor_refusal
from ._errors import brief
from ._lifecycle import AsyncResource
from ._refs import materialized
from .columns import PackedRows, joined_numbers
from .memory._copies import BulkCopy, bytes_copy, copy_many
from .memory._segments import AVAILABLE as SHARED_MEMORY
from .memory._segments import MEMFD_NAME, Memory, exports

__all__ = [
    "CONNECT_TIMEOUT",
    "MEMFD_NAME",
    "SHARED_MEMORY",
    "AsyncResource",
    "BulkCopy",
    "Memory",
    "PackedRows",
    "brief",
    "bytes_copy",
    "check_address",
    "check_bind",
    "copy_many",
    "curve_keys",
    "exports",
    "joined_numbers",
    "materialized",
    "tensor_buffer",
    "tensor_refusal",
]
