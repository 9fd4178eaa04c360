"""One profiled training step, summarized: where the device time goes (scripts/profile_step.py, and Unsloth's
child process in poros/harness/unsloth.py, so both methods are summarized alike)."""

from __future__ import annotations

import bisect

import torch
from torch.profiler import ProfilerActivity, profile


def activities(device: str) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])


def _merged(ranges: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """`ranges` as disjoint busy intervals in time order (overlapping or touching ones joined)."""
    out: list[list[float]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _union_us(ranges: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _merged(ranges))


def _gaps_us(ranges: list[tuple[float, float]]) -> list[float]:
    """The idle intervals between the first and the last of `ranges` (microseconds), longest first."""
    busy = _merged(ranges)
    return sorted((c - b for (_, b), (c, _) in zip(busy, busy[1:])), reverse=True)


def link_idle(copies: list[tuple[float, float]],
              kernels: list[tuple[float, float]]) -> list[tuple[float, float, float]]:
    """Where no host->device copy runs within the step's span on the device (its first kernel or copy to its last),
    in time order, each as (start, end, the compute kernels' busy time within it), microseconds. A copy-bound step
    takes its copies' time plus these intervals; compute within them is work no copy overlaps (the blocks the
    buffers already hold, the head, the optimizer), the rest the host's."""
    spans = copies + kernels
    if not spans:
        return []
    at, end = min(a for a, _ in spans), max(b for _, b in spans)
    idle = []
    for a, b in _merged(copies):
        if a > at:
            idle.append((at, a))
        at = max(at, b)
    if end > at:
        idle.append((at, end))
    busy = _merged(kernels)
    return [(a, b, sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)) for a, b in idle]


def compute_waits(kernels: list[tuple[float, float]],
                  copies: list[tuple[float, float, object]]) -> dict[str, list[float]]:
    """What the compute waited for: each gap between its busy intervals goes to the stream of the host->device copy
    that ended last within it (the kernel after the gap waited for that copy), or to `host` where none ended there
    (the device waited for the host to launch), as {who: [gaps, microseconds]}. `copies`: (start, end, stream)."""
    busy = _merged(kernels)
    ends = sorted((e, stream) for _, e, stream in copies)
    at = [e for e, _ in ends]
    out: dict[str, list[float]] = {}
    for (_, b), (c, _) in zip(busy, busy[1:]):
        k = bisect.bisect_right(at, c) - 1  # the copy that ended last by the gap's end
        who = f"stream {ends[k][1]}" if k >= 0 and at[k] > b else "host"
        n, us = out.get(who, [0, 0.0])
        out[who] = [n + 1, us + c - b]
    return out


def _overlap_us(ranges: list[tuple[float, float]]) -> float:
    """The time at least two of `ranges` run at once."""
    points = sorted([(a, 1) for a, _ in ranges] + [(b, -1) for _, b in ranges], key=lambda p: (p[0], p[1]))
    at, depth, total = 0.0, 0, 0.0
    for t, d in points:
        if depth >= 2:
            total += t - at
        at, depth = t, depth + d
    return total


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


def _by_stream(copies: list[tuple[float, float, object]]) -> dict:
    out: dict = {}
    for a, b, stream in copies:
        out.setdefault(stream, []).append((a, b))
    return out


def summarize(prof, wall_s: float, top: int, steps: int = 1) -> dict:
    """The profile of `steps` consecutive steps (`wall_s` their time, from the first's start to the device's end of
    the last), its times per step: several steps profiled without a synchronization between them show the steady
    state, where the host enqueues a step while the device still runs the one before; a single step starts after a
    synchronization, with the device idle until its first kernels arrive."""
    if steps < 1:
        raise ValueError(f"steps: expected at least 1, got {steps}")
    kernels, copies, h2d_streams, cpu = [], [], [], []
    by_kind: dict[str, float] = {}
    launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            cpu.append((e.name, e.time_range.start, e.time_range.end))
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rng = (e.time_range.start, e.time_range.end)
            (copies if "memcpy" in e.name.lower() else kernels).append(rng)
            if "htod" in e.name.lower():
                h2d_streams.append((*rng, e.device_resource_id))
            kind = kind_of(e.name)
            by_kind[kind] = by_kind.get(kind, 0.0) + (rng[1] - rng[0])
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += 1
    h2d = [(a, b) for a, b, _ in h2d_streams]
    wall_us = wall_s * 1e6
    per = 1e6 * steps  # microseconds of the whole profile to seconds a step
    by_device = sorted(prof.key_averages(), key=lambda a: getattr(a, "device_time_total", 0.0), reverse=True)
    gaps = _gaps_us(kernels)
    idle = link_idle(h2d, kernels)  # none without copies
    longest = sorted(idle, key=lambda r: r[1] - r[0], reverse=True)
    start = min(a for a, _ in h2d + kernels) if h2d else 0.0
    return {
        "profiled_steps": steps,
        "wall_s": round(wall_s / steps, 4),
        "gpu_compute_busy": round(_union_us(kernels) / wall_us, 3) if kernels else None,
        # where compute kernels leave the device idle within the step: in all, and the longest gaps
        "compute_idle_s": round(sum(gaps) / per, 4),
        "compute_idle_longest_ms": [round(g / 1e3, 2) for g in gaps[:8]],
        "gpu_copy_busy": round(_union_us(copies) / wall_us, 3) if copies else None,
        # where the host->device link idles within the step (nothing copied in): in all, the compute kernels' share
        # of that time, and the longest such intervals as [ms, ms of compute within]
        "link_idle_s": round(sum(b - a for a, b, _ in idle) / per, 4) if h2d else None,
        "link_idle_compute_s": round(sum(c for _, _, c in idle) / per, 4) if h2d else None,
        "link_idle_longest_ms": [[round((b - a) / 1e3, 2), round(c / 1e3, 2)] for a, b, c in longest[:8]],
        # the four longest, in time order from the step's start: where each lies and what the host ran meanwhile
        "link_idle_host": [{"at_ms": round((a - start) / 1e3, 2), "ms": round((b - a) / 1e3, 2),
                            "host": host_within((a, b), cpu)} for a, b, _ in sorted(longest[:4])],
        # the host->device copies by stream (the weights' and, where a plan keeps saved inputs in host memory, the
        # stream that brings them back) as [copies, ms of copy time], the time two of them ran at once, and what
        # the compute waited for between its kernels, as [gaps, ms] by the stream whose copy it waited for
        "h2d_by_stream": {str(stream): [round(len(r) / steps), round(sum(b - a for a, b in r) / 1e3 / steps, 2)]
                          for stream, r in sorted(_by_stream(h2d_streams).items(), key=lambda kv: str(kv[0]))},
        "h2d_concurrent_ms": round(_overlap_us(h2d) / 1e3 / steps, 2),
        "compute_waits_ms": {who: [round(n / steps), round(us / 1e3 / steps, 2)]
                             for who, (n, us) in sorted(compute_waits(kernels, h2d_streams).items())},
        "kernel_launches": round(launches / steps),
        "device_s_by_kind": {k: round(v / per, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_device_ops": [
            {"name": a.key[:80], "calls": round(a.count / steps),
             "device_ms": round(getattr(a, "device_time_total", 0.0) / 1e3 / steps, 2)}
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
