"""TransferQueue's metadata types, held as arrays: ``BatchMeta`` (the samples a batch names,
its field schema and ``extra_info``) and ``KVBatchMeta`` (the KV API's keys and tags).

``from_arrays``, ``samples_of`` and ``kv_meta_owning`` are the shim's own: they build a batch
from arrays and read them, with no per-sample work.
"""

from ._batch import BatchMeta, from_arrays, samples_of
from ._kv import KVBatchMeta, kv_meta_owning
from ._samples import Samples
from ._schema import extract_field_schema

__all__ = [
    "BatchMeta",
    "KVBatchMeta",
    "Samples",
    "extract_field_schema",
    "from_arrays",
    "kv_meta_owning",
    "samples_of",
]
