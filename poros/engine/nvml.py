"""Peak device memory as the driver sees it (what nvidia-smi shows), sampled through NVML."""

from __future__ import annotations

import os
import threading
import time

import torch


class NvmlPeak:
    """Samples this process's device memory through NVML (what nvidia-smi would show)."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak, self._stop = interval, None, threading.Event()

    def __enter__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            idx = torch.cuda.current_device()
            self._h, self._nvml = pynvml.nvmlDeviceGetHandleByIndex(idx), pynvml
        except Exception:
            return self
        self.peak = 0
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _sample(self) -> None:
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._h)
        except Exception:
            return
        used = sum(p.usedGpuMemory or 0 for p in procs if p.pid == os.getpid())
        if not used:  # inside containers pids may not match: fall back to the device's used memory
            used = self._nvml.nvmlDeviceGetMemoryInfo(self._h).used
        self.peak = max(self.peak, used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        if self.peak is not None:
            self._t.join()
            self._sample()
