"""How busy a run's GPUs were: NVML's utilization samples over the run."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["GpuBusy"]


class GpuBusy:
    """The GPU busy share of a run on ``devices`` (this process's CUDA indices), from
    NVML's utilization samples: each is the percent of its sample period (1/6 s to 1 s,
    by GPU) in which a kernel ran. :meth:`read` takes the samples since the last read
    (call it at each step's end: the driver keeps a short buffer; ``read(every=s)`` skips
    a read within ``s`` seconds of the last: NVML's call took 2 ms of a step's driver on
    an H200 host); :meth:`percent` is their mean over the run and the GPUs. Without
    ``nvidia-ml-py`` (the ``[demo]`` extra) or NVML, ``why`` says why nothing is
    measured; it never fails the run."""

    def __init__(self, devices: Sequence[int]) -> None:
        self.why: str | None = None
        self._values: list[int] = []
        self._handles: list[Any] = []
        self._since: list[int] = []
        self._started = False
        self._read_at = -float("inf")  # monotonic seconds of the last read
        try:
            import pynvml
        except ImportError:
            self.why = "nvidia-ml-py is not installed (pip install 'rlferry[demo]')"
            return
        self._nvml: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            self.why = f"NVML did not start: {e}"
            return
        self._started = True
        now = time.time_ns() // 1000  # NVML stamps samples in microseconds of the host clock
        try:
            for d in devices:
                uuid = str(torch.cuda.get_device_properties(d).uuid)
                self._handles.append(pynvml.nvmlDeviceGetHandleByUUID(
                    uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
                ))  # fmt: skip
                self._since.append(now)
        except pynvml.NVMLError as e:
            self._stop(f"NVML has no handle of CUDA device {d}: {e}")

    def read(self, every: float = 0.0) -> None:
        """Take every GPU's utilization samples since the last read, unless that read was
        less than ``every`` seconds ago (the buffer holds seconds of samples)."""
        now = time.monotonic()
        if self.why is not None or now - self._read_at < every:
            return
        self._read_at = now
        nvml = self._nvml
        try:
            for i, handle in enumerate(self._handles):
                try:
                    _, samples = nvml.nvmlDeviceGetSamples(
                        handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, self._since[i]
                    )
                except nvml.NVMLError as e:
                    if e.value != nvml.NVML_ERROR_NOT_FOUND:
                        raise
                    continue  # no sample since the last read
                new = [s for s in samples if s.timeStamp > self._since[i]]
                self._values += [s.sampleValue.uiVal for s in new]
                self._since[i] = max((s.timeStamp for s in new), default=self._since[i])
        except nvml.NVMLError as e:
            self._stop(f"NVML's utilization samples failed: {e}")

    def percent(self) -> float | None:
        """The mean utilization (percent) of the samples read, or None (see ``why``)."""
        if self.why is None and not self._values:
            self.why = "NVML gave no utilization sample during the run"
        return None if self.why is not None else sum(self._values) / len(self._values)

    def close(self) -> None:
        """Stop NVML (what was read stays)."""
        if self._started:
            self._started = False
            self._handles = []
            self._nvml.nvmlShutdown()

    def _stop(self, why: str) -> None:
        self.why = why
        self._values = []
        self.close()
