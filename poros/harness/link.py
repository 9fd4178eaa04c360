"""The host-to-device link as this process finds it: a pinned copy probe, once per process.

A streamed step cannot be faster than its bytes over the link, so a row that records the link's bandwidth
measured in its own process can say how far its step is from that floor (`copy_floor_s`): a slow link and
a slow schedule then read differently. A probe can read below what the link carries (a copy slowed by
anything else on the host); the steps' own weight copies then show the link carrying more, and the floor
takes the best of the two (`link_figure`), so that no step reads as faster than its floor.
"""

from __future__ import annotations

from functools import lru_cache

PROBE_BYTES = 1 << 30  # a power of two: the pinned buffer is exactly this size
PROBE_COPIES = 5


@lru_cache(maxsize=None)
def h2d_gbps(device: str = "cuda") -> float | None:
    """The best of `PROBE_COPIES` pinned host->device copies of `PROBE_BYTES`, in GB/s (None off CUDA).

    The best, not the mean: the probe asks what the link can carry, and a copy slowed by anything else on
    the host is not the link's figure."""
    import torch  # here: a page reads `link_figure` and `copy_floor` without torch

    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    host = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
    best = None
    try:
        dev.copy_(host, non_blocking=True)  # the first copy pays for mapping the pages
        for _ in range(PROBE_COPIES):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dev.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            best = seconds if best is None else min(best, seconds)
    finally:
        del host, dev
        torch.cuda.empty_cache()
    return PROBE_BYTES / best / 1e9


def link_figure(rates) -> float | None:
    """The link's bandwidth a copy floor is taken at, in GB/s: the best of `rates`, the probes' and the rates the
    steps' own weight copies reached (`copy_gbps`, each at most what the link carried while it copied); None and
    non-positive entries are skipped, and None where none is left. Each is a rate the link was seen to carry, so the
    best of them is the floor's."""
    seen = [x for x in rates if isinstance(x, (int, float)) and x > 0]
    return max(seen) if seen else None


def copy_floor(weight_bytes_per_step: int | None, gbps: float | None) -> float | None:
    """Seconds a step's weight copies take at `gbps` at the least (None where either is unknown)."""
    if not weight_bytes_per_step or not gbps:
        return None
    return weight_bytes_per_step / (gbps * 1e9)
