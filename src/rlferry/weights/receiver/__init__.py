"""The receiver side of a push: :class:`WeightReceiver` (the public class: its life, its
connection, the serving thread and the waiters), the :class:`~._loading.Loader` it owns
(each push's messages: the plan and buffers, the loads, the commit), and the watch over
the NCCL streams it takes part in (``_watch``)."""

from ._receiver import WeightReceiver

__all__ = ["WeightReceiver"]
