"""What the demo does when a part of the run is lost: an engine (``Engines``: each slot's
engine watched, a lost one replaced under its name, the losses for the report)."""

from ._engines import ENGINE_RESTARTS, Engines, Loss, generating
from ._slots import process_slots, ray_slots

__all__ = ["ENGINE_RESTARTS", "Engines", "Loss", "generating", "process_slots", "ray_slots"]
