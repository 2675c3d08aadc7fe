"""The bytes a changed tensor travels in when only its changed elements are pushed.

A tensor of ``numel`` elements cut in blocks of :data:`BLOCK`: the changed elements of
each block (an int16 count a block), their new values (16-byte aligned) and each one's
place in its block (one byte). The same arithmetic sizes the pushed record
(``rlferry.weights.delta``) and predicts a delta push (:mod:`._savings`).
"""

from __future__ import annotations

__all__ = ["BLOCK", "SPARSE_AT_MOST", "layout", "sent_bytes"]

# An element's place in its block fits one byte: a changed bf16 element costs 3 bytes
# (its value and its offset) and a block 2 (its count): 1.5 x the changed bytes and 0.4%
# of the dense bytes in all.
BLOCK = 256
SPARSE_AT_MOST = 0.9  # a tensor goes sparse when that is at least 10% smaller than dense
_ALIGN = 16


def layout(numel: int, changed: int, itemsize: int) -> tuple[int, int, int, int]:
    """``(blocks, values_at, offsets_at, nbytes)`` of a tensor of ``numel`` elements of
    ``itemsize`` bytes of which ``changed`` changed."""
    blocks = -(-numel // BLOCK)
    values_at = -(-2 * blocks // _ALIGN) * _ALIGN
    offsets_at = values_at + changed * itemsize
    return blocks, values_at, offsets_at, offsets_at + changed


def sent_bytes(numel: int, changed: int, itemsize: int) -> int:
    """The bytes pushed for a tensor with ``changed`` of its elements changed: none when
    nothing changed, the sparse record, or the tensor whole where sparse does not pay."""
    if changed == 0:
        return 0
    dense = numel * itemsize
    sparse = layout(numel, changed, itemsize)[3]
    return sparse if sparse <= SPARSE_AT_MOST * dense else dense
