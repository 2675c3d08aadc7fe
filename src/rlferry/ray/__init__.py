"""rlferry on Ray (the ``[ray]`` extra): the queue's services and the engines as actors of
a job, placed by placement groups, found by name, their deaths reported by Ray. The
payload never goes through Ray: rollouts and weights move over rlferry's own wire.

>>> with RayQueue.start("grpo", tasks=("train",)) as q:   # on the driver
...     c = rlferry.ray.queue("grpo")                      # in any task or actor of the job
"""

from ._common import LaunchError
from ._engines import RayEngine, RayEngines
from ._placement import READY_TIMEOUT, free_resources, place, stop_all
from ._queue import RayQueue, async_queue, queue
from ._weights import weight_sender

__all__ = ["READY_TIMEOUT", "LaunchError", "RayEngine", "RayEngines", "RayQueue", "async_queue",
           "free_resources", "place", "queue", "stop_all",
           "weight_sender"]  # fmt: skip
