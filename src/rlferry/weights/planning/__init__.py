"""The planner and the plan primitives of the weight plane: pure functions of layouts.

Nothing here opens a socket or starts a thread, and only :func:`plan_weights` reads a
file (a model's ``config.json``): every sender and receiver computes the same plan from
the same inputs, apart.

- Layouts, as boxes of the full tensors: :class:`TrainerLayout` (what each trainer
  rank owns: :func:`fsdp_layout`, :func:`dtensor_layout`) and :class:`EngineLayout`
  (what each engine rank needs, :class:`ParamLayout` of :class:`Part`:
  :func:`tp_layout`, ``EngineLayout.whole``), from the tensors' :class:`TensorSpec`
  (:func:`specs_of`); the engine dtype :data:`BLOCK_FP8` (``"fp8_block128"``) keeps the
  weights of linear layers in block FP8 (``float8_e4m3fn`` values and float32
  ``<name>_scale_inv``, one per 128 x 128 block).
- :class:`ShardPlan`: which bytes each trainer rank sends (its :class:`Piece`) and where
  each engine rank copies them (:class:`Copy`).
- :func:`predict` (a :class:`Cluster` in, a :class:`Prediction` out) and
  :func:`plan_weights` (``rlferry plan-weights``): an update's bytes and time on a
  cluster one does not have.
"""

from .._errors import BlockFP8Error
from ._blocks import BLOCK_FP8
from ._layouts import EngineLayout, ParamLayout, Part, TrainerLayout, dtensor_layout, fsdp_layout
from ._plan_weights import plan_weights
from ._predict import Cluster, Prediction, predict
from ._shard_plan import Copy, Piece, ShardPlan
from ._specs import TensorSpec, specs_of
from ._tp import tp_layout

__all__ = [
    "BLOCK_FP8",
    "BlockFP8Error",
    "Cluster",
    "Copy",
    "EngineLayout",
    "ParamLayout",
    "Part",
    "Piece",
    "Prediction",
    "ShardPlan",
    "TensorSpec",
    "TrainerLayout",
    "dtensor_layout",
    "fsdp_layout",
    "plan_weights",
    "predict",
    "specs_of",
    "tp_layout",
]
