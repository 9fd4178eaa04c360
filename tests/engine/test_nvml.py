"""NvmlPeak: the process's device memory peak through NVML, and None where NVML cannot answer."""

from __future__ import annotations

import os
import sys
import time
import types

import pytest
import torch

from poros.engine.runtime.nvml import NvmlPeak


class FakeNvml(types.ModuleType):
    """A pynvml stand-in whose process list and device memory the test sets step by step."""

    def __init__(self, samples, device_used=0, fail_init=False):
        super().__init__("pynvml")
        self.samples, self.device_used, self.fail_init = list(samples), device_used, fail_init

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, idx):
        return ("handle", idx)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        used = self.samples.pop(0) if len(self.samples) > 1 else self.samples[0]
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in used]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=self.device_used)


@pytest.fixture
def fake_nvml(monkeypatch):
    def install(fake):
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        return fake
    return install


def test_peak_is_the_largest_sample_of_this_process(fake_nvml):
    me, other = os.getpid(), os.getpid() + 1
    fake_nvml(FakeNvml([[(me, 100), (other, 10**9)], [(me, 300)], [(me, 200)]]))
    with NvmlPeak(interval=0.001) as n:
        deadline = time.monotonic() + 60
        while n._nvml.samples[1:] and time.monotonic() < deadline:  # wait for the sampler to reach the last sample
            time.sleep(0.001)
    assert n.peak == 300  # the other process's 1 GB is not this process's


def test_peak_falls_back_to_device_memory_when_pids_do_not_match(fake_nvml):
    fake_nvml(FakeNvml([[(os.getpid() + 1, 500)]], device_used=7000))
    with NvmlPeak(interval=0.001) as n:
        pass
    assert n.peak == 7000


def test_peak_is_none_without_nvml(fake_nvml):
    fake_nvml(FakeNvml([[(os.getpid(), 100)]], fail_init=True))
    with NvmlPeak() as n:
        pass
    assert n.peak is None
