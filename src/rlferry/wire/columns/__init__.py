"""Columns kept packed on the wire: a list of strings or bytes as one data frame and its
offsets (``_strings``: :class:`PackedStrings`), a list of tensors as the one flat tensor
its rows view (``_ragged``: :class:`RaggedRows`, and :class:`PackedRows` where a service only
stores and forwards it)."""

from ._ragged import PackedRows, RaggedRows, joined_numbers
from ._strings import KINDS, PackedStrings, check_offsets, pack_strings

__all__ = [
    "KINDS",
    "PackedRows",
    "PackedStrings",
    "RaggedRows",
    "check_offsets",
    "joined_numbers",
    "pack_strings",
]
