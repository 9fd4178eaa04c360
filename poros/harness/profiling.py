"""One profiled training step, summarized: where the device time goes (scripts/profile_step.py, and Unsloth's
child process in poros/harness/unsloth.py, so both methods are summarized alike)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def activities(device: str) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])


def _union_us(ranges: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(ranges):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _gaps_us(ranges: list[tuple[float, float]]) -> list[float]:
    """The idle intervals between the first and the last of `ranges` (microseconds), longest first."""
    gaps, end = [], None
    for a, b in sorted(ranges):
        if end is not None and a > end:
            gaps.append(a - end)
        end = b if end is None else max(end, b)
    return sorted(gaps, reverse=True)


def _merged(ranges: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def link_idle_intervals(copies: list[tuple[float, float]],
                        kernels: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Where no host->device copy runs within the step's span on the device (its first kernel or copy to its last),
    in time order."""
    spans = copies + kernels
    if not spans:
        return []
    start, end = min(a for a, _ in spans), max(b for _, b in spans)
    idle, at = [], start
    for a, b in _merged(copies):
        if a > at:
            idle.append((at, a))
        at = max(at, b)
    if end > at:
        idle.append((at, end))
    return idle


def _overlap(busy: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)


def link_idle(copies: list[tuple[float, float]], kernels: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """`link_idle_intervals`, each as (its length, the compute kernels' busy time inside it), longest first
    (microseconds). A copy-bound step takes its copies' time plus these intervals; compute within them is work no
    copy overlaps (the blocks the buffers already hold, the head, the optimizer), the rest the host's."""
    busy = _merged(kernels)
    return sorted(((b - a, _overlap(busy, a, b)) for a, b in link_idle_intervals(copies, kernels)), reverse=True)


def host_within(interval: tuple[float, float], cpu: list[tuple[str, float, float]], top: int = 6) -> list:
    """What the host ran during `interval`: the CPU-side operators (name, start, end) overlapping it, by their time
    within it, most first, as [name, ms] (nested operators each count: a parent's time holds its children's)."""
    a, b = interval
    by_name: dict[str, float] = {}
    for name, x, y in cpu:
        inside = min(b, y) - max(a, x)
        if inside > 0:
            by_name[name] = by_name.get(name, 0.0) + inside
    return [[n, round(t / 1e3, 2)] for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]


# Kinds of device kernels, by name (first match wins): where a long-context step's time goes.
KINDS = (
    ("attention_backward", ("flash_bwd", "bwd_kernel", "attention_backward", "fmha_cutlassB")),
    ("attention_forward", ("flash_fwd", "fwd_kernel", "fmha_cutlassF", "attention_forward")),
    ("copies", ("memcpy",)),
    ("nf4_dequantize", ("dequantize",)),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "splitk")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def summarize(prof, wall_s: float, top: int) -> dict:
    kernels, copies, h2d, cpu = [], [], [], []
    by_kind: dict[str, float] = {}
    launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            cpu.append((e.name, e.time_range.start, e.time_range.end))
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rng = (e.time_range.start, e.time_range.end)
            (copies if "memcpy" in e.name.lower() else kernels).append(rng)
            if "htod" in e.name.lower():
                h2d.append(rng)
            kind = kind_of(e.name)
            by_kind[kind] = by_kind.get(kind, 0.0) + (rng[1] - rng[0])
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += 1
    wall_us = wall_s * 1e6
    by_device = sorted(prof.key_averages(), key=lambda a: getattr(a, "device_time_total", 0.0), reverse=True)
    gaps = _gaps_us(kernels)
    idle = link_idle(h2d, kernels) if h2d else []
    longest = sorted(link_idle_intervals(h2d, kernels), key=lambda r: r[1] - r[0], reverse=True)[:4] if h2d else []
    return {
        "wall_s": round(wall_s, 4),
        "gpu_compute_busy": round(_union_us(kernels) / wall_us, 3) if kernels else None,
        # where compute kernels leave the device idle within the step: in all, and the longest gaps
        "compute_idle_s": round(sum(gaps) / 1e6, 4),
        "compute_idle_longest_ms": [round(g / 1e3, 2) for g in gaps[:8]],
        "gpu_copy_busy": round(_union_us(copies) / wall_us, 3) if copies else None,
        # where the host->device link idles within the step (nothing copied in): in all, the compute kernels' share
        # of that time, and the longest such intervals as [ms, ms of compute within]
        "link_idle_s": round(sum(g for g, _ in idle) / 1e6, 4) if h2d else None,
        "link_idle_compute_s": round(sum(c for _, c in idle) / 1e6, 4) if h2d else None,
        "link_idle_longest_ms": [[round(g / 1e3, 2), round(c / 1e3, 2)] for g, c in idle[:8]],
        # the four longest, in time order from the step's start: where each lies and what the host ran meanwhile
        "link_idle_host": [{"at_ms": round((a - min(x for x, _ in h2d + kernels)) / 1e3, 2),
                            "ms": round((b - a) / 1e3, 2), "host": host_within((a, b), cpu)}
                           for a, b in sorted(longest)],
        "kernel_launches": launches,
        "device_s_by_kind": {k: round(v / 1e6, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_device_ops": [
            {"name": a.key[:80], "calls": a.count, "device_ms": round(getattr(a, "device_time_total", 0.0) / 1e3, 2)}
            for a in by_device[:top]
        ],
    }


def profiled(step, device: str):
    """Run `step()` under torch.profiler; (its result, the profile)."""
    with profile(activities=activities(device)) as prof:
        result = step()
        if device == "cuda":
            torch.cuda.synchronize()
    return result, prof
