"""Device memory as the driver sees it (what nvidia-smi shows), read through NVML; and, beside it, how often
torch's allocator had to release its cache to find memory (`alloc_retries`).

NVML lists each process's device memory (nvmlDeviceGetComputeRunningProcesses). A process inside a
container whose pid namespace the driver does not see is not found there by its pid; then the device's
used memory (every process's) stands in, and `source` says so.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from poros.engine.planning.memory import DeviceMemory

PROCESS, DEVICE = "process", "device"  # what a reading measured: this process's memory, or the whole device's


def _nvml():
    """pynvml, initialised; None where NVML is missing (no driver, or the package not installed)."""
    try:
        import pynvml  # optional: only CUDA hosts have it

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def handle(nvml, index: int):
    """NVML's handle of torch's device `index`: matched by UUID, since NVML numbers every GPU of the host
    while torch numbers those CUDA_VISIBLE_DEVICES leaves visible."""
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            if _s(nvml.nvmlDeviceGetUUID(h)).removeprefix("GPU-") == uuid.removeprefix("GPU-"):
                return h
    except Exception:
        pass
    return nvml.nvmlDeviceGetHandleByIndex(index)


def used(nvml, h, pid: int | None = None) -> tuple[int, str]:
    """(bytes, source): process `pid`'s device memory (PROCESS), or where NVML does not list it, the
    device's used memory (DEVICE)."""
    pid = os.getpid() if pid is None else pid
    try:
        procs = nvml.nvmlDeviceGetComputeRunningProcesses(h)
    except Exception:
        procs = []
    mine = [p.usedGpuMemory for p in procs if p.pid == pid and p.usedGpuMemory]
    if mine:
        return sum(mine), PROCESS
    return nvml.nvmlDeviceGetMemoryInfo(h).used, DEVICE


def device_memory(device: torch.device) -> DeviceMemory:
    """The CUDA `device`'s memory as this process finds it: total and free (torch.cuda.mem_get_info, which
    initialises CUDA), what this process holds (NVML) and of that what is not torch's allocator's, the
    context so far; the last two are 0 and None where NVML cannot tell this process apart."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    nvml = _nvml()
    if nvml is None:
        return DeviceMemory(total=total, free=free, allocated=allocated)
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        held, source = used(nvml, handle(nvml, index))
    finally:
        nvml.nvmlShutdown()
    if source != PROCESS:
        return DeviceMemory(total=total, free=free, allocated=allocated)
    return DeviceMemory(total=total, free=free, process=held,
                        context=max(0, held - torch.cuda.memory_reserved(device)), allocated=allocated)


class NvmlPeak:
    """Samples this process's device memory through NVML (what nvidia-smi would show) while inside.

    `peak` is None where NVML is missing; `source` is PROCESS, or DEVICE where the process is not listed
    and the device's used memory (every process's) was sampled instead."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak, self.source, self._stop = interval, None, None, threading.Event()

    def __enter__(self):
        self._nvml = _nvml()
        if self._nvml is None:
            return self
        try:
            self._h = handle(self._nvml, torch.cuda.current_device())
        except Exception:
            return self
        self.peak = 0
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _sample(self) -> None:
        try:
            n, source = used(self._nvml, self._h)
        except Exception:
            return
        if self.source != DEVICE:  # once a reading is the device's, the peak is the device's
            self.source = source
        self.peak = max(self.peak, n)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        if self.peak is not None:
            self._t.join()
            self._sample()


def alloc_retries(device: str) -> int | None:
    """torch's count of allocations that released the allocator's cache and tried again (None off CUDA)."""
    if device != "cuda":
        return None
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)
