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
    kernels, copies = [], []
    by_kind: dict[str, float] = {}
    launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rng = (e.time_range.start, e.time_range.end)
            (copies if "memcpy" in e.name.lower() else kernels).append(rng)
            kind = kind_of(e.name)
            by_kind[kind] = by_kind.get(kind, 0.0) + (rng[1] - rng[0])
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += 1
    wall_us = wall_s * 1e6
    by_device = sorted(prof.key_averages(), key=lambda a: getattr(a, "device_time_total", 0.0), reverse=True)
    gaps = _gaps_us(kernels)
    return {
        "wall_s": round(wall_s, 4),
        "gpu_compute_busy": round(_union_us(kernels) / wall_us, 3) if kernels else None,
        # where compute kernels leave the device idle within the step: in all, and the longest gaps
        "compute_idle_s": round(sum(gaps) / 1e6, 4),
        "compute_idle_longest_ms": [round(g / 1e3, 2) for g in gaps[:8]],
        "gpu_copy_busy": round(_union_us(copies) / wall_us, 3) if copies else None,
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
