"""Generation engines that implement :class:`rlferry.control.Engine`.

``HFEngine`` (in :mod:`rlferry.engines.hf`) serves a Hugging Face ``transformers``
causal LM with its own batched decode loop; it needs the ``hf`` extra
(``pip install 'rlferry[hf]'``), imported only when an engine is made.
"""

from ._errors import NotStarted
from .hf import HFEngine

__all__ = ["HFEngine", "NotStarted"]
