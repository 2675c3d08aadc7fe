"""The sender side of a push: :class:`WeightSender` (the public class), the
:class:`~._pusher.Pusher` that runs its pushes (the :class:`~._preparing.Preparer`,
:class:`~._launching.Launcher` and :class:`~._finishing.Finisher` it owns), the parts it
runs them over (``_parts``: the transport, the :class:`~._hub.Hub` and the
:class:`~._course.Course` of each push on the wire loop), and the driver of a push's
steps (``_turns``)."""

from ._sender import WeightSender

__all__ = ["WeightSender"]
