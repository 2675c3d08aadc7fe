"""Delta pushes: send only the elements that changed since the version a receiver holds.

A sender made with ``delta_budget`` keeps the bytes of the version it pushed last
(``_base``); a push whose every receiver committed that version is diffed against it,
bit for bit, and each tensor goes sparse (:class:`Delta`: counts, offsets and values),
dense, or not at all (``_encoding``), through the plan, the buckets and every transport
as any tensors do; the ``Setup`` of the push says how to read them (``_header``). Which
pushes are deltas is measured (``_policy``). A receiver made with ``deltas=`` applies
them: to the engine's tensors in place, or to a copy it keeps (``_applying``).
"""

from .._errors import DeltaBaseMissing
from ._record import BLOCK, Delta

__all__ = ["BLOCK", "Delta", "DeltaBaseMissing"]
