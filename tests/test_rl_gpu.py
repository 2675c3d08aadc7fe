"""The demo's GPU busy share (NVML's utilization samples, through the real nvidia-ml-py)."""

import time

import pytest
import torch

from rlferry.rl._gpu import GpuBusy

pynvml = pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the [demo] extra)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without NVIDIA's driver")
def test_without_nvml_nothing_is_measured_and_why_names_nvml():
    busy = GpuBusy([0])
    busy.read()
    assert busy.percent() is None
    assert busy.why is not None and busy.why.startswith("NVML did not start: ")
    busy.close()  # nothing started: nothing to stop


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and its driver")
def test_a_gpu_kept_busy_reads_busy():
    busy = GpuBusy([0])
    assert busy.why is None, busy.why
    a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
    for _ in range(1000):  # about 2 s of matmuls on an H100: NVML samples every 1/6 s to 1 s
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    busy.read()
    share = busy.percent()
    assert share is not None and 50 <= share <= 100, busy.why
    time.sleep(2.5)  # the GPU idle: samples of 0%
    busy.read(every=60)  # within a minute of the last read: skipped
    assert busy.percent() == share
    busy.read()
    idle = busy.percent()
    busy.close()
    assert idle is not None and idle < share
