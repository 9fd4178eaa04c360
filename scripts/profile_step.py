"""Where a training step's time goes: torch.profiler over one step of each method (a probe, not a test).

    python3 scripts/profile_step.py qwen3-32b [--methods poros,resident] [--attention math] [--top 25]
    python3 scripts/profile_step.py qwen2.5-72b --methods poros --attention fast --deterministic \
        --seq-len 32768 --loss-chunk 4096 --variant offload_inputs=true,vram_budget=40GB

Builds the model once; per method runs one warm-up step, then profiles one step and prints one
JSON line: wall time, the share of it the GPU spent in compute kernels and in host->device copies
(union of intervals, so overlap is not double-counted), kernel launches, device time per kind of
kernel (attention forward and backward, matmuls, NF4 dequantization, copies, the rest), and the top
kernels by total device time. --variant takes schedule settings (scripts/variant.py). With --out DIR
the full tables are written there too. On CPU only the wall time and the operator table mean anything.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from poros.engine.methods import make_trainer
from poros.store.build import build_store
from poros.config import Method, TrainConfig
from poros.engine.trainer import enable_determinism

sys.path.insert(0, str(Path(__file__).parent))
from variant import echo, parse_variant  # noqa: E402  (one parser for schedule settings)


def _union_us(ranges: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(ranges):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


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
    return {
        "wall_s": round(wall_s, 4),
        "gpu_compute_busy": round(_union_us(kernels) / wall_us, 3) if kernels else None,
        "gpu_copy_busy": round(_union_us(copies) / wall_us, 3) if copies else None,
        "kernel_launches": launches,
        "device_s_by_kind": {k: round(v / 1e6, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_device_ops": [
            {"name": a.key[:80], "calls": a.count, "device_ms": round(getattr(a, "device_time_total", 0.0) / 1e3, 2)}
            for a in by_device[:top]
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--methods", default="poros,resident")
    p.add_argument("--attention", default="math")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--loss-chunk", type=int)
    p.add_argument("--variant", default="", help="schedule settings for poros, KEY=VALUE,... (e.g. cuda_graphs=true,vram_budget=24GB)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.deterministic:
        enable_determinism()
    variant = parse_variant(args.variant)
    from poros.provenance import provenance
    store, _ = build_store(args.model, device=args.device)
    if args.device == "cuda":
        store.pin()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    for method in args.methods.split(","):
        cfg = TrainConfig(model=args.model, seq_len=args.seq_len, block_size=args.block_size, device=args.device,
                          attention=args.attention, deterministic=args.deterministic, loss_chunk=args.loss_chunk)
        if Method(method) is Method.POROS:
            cfg = cfg.replace(**variant)
        trainer = make_trainer(Method(method), store, cfg)
        trainer.step()  # warm-up: allocator, cuBLAS handles, lazy init
        with profile(activities=activities) as prof:
            result = trainer.step()
            if args.device == "cuda":
                torch.cuda.synchronize()
        row = {"model": args.model, "method": method, "attention": args.attention, "seq_len": args.seq_len,
               "variant": echo(variant) if Method(method) is Method.POROS else {},
               **summarize(prof, result.seconds, args.top), "counters": result.counters,
               "provenance": provenance()}
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            sort = "device_time_total" if args.device == "cuda" else "cpu_time_total"
            (args.out / f"{args.model}-{method}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=60))
        trainer.close()
        del trainer
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
