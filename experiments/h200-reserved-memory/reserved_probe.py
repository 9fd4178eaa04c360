"""Where a poros trainer's reserved device memory sits: the caching allocator's segments grouped by
memory pool (the default pool, each CUDA-graph pool) after a few steps, beside the allocated and
reserved peaks and the plan's prediction (a GPU probe, not a test).

    python3 experiments/h200-reserved-memory/reserved_probe.py qwen2.5-72b --seq-len 16384 --loss-chunk 4096 --attention fast \
        --deterministic --variant cuda_graphs=true,offload_inputs=true,vram_budget=24GB [--steps 2]

Run it again under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to see what fragmentation costs.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

from poros.store.build import build_store
from poros.config import TrainConfig
from poros.engine.methods.executor import PorosTrainer
from poros.provenance import provenance
from poros.engine.methods.trainer import enable_determinism

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from profile_step import echo, parse_variant  # noqa: E402  (one parser for schedule settings)

GB = 1e9


def by_pool() -> dict[str, dict]:
    """Reserved and allocated bytes per memory pool, from the allocator's snapshot."""
    pools: dict[str, dict] = defaultdict(lambda: {"segments": 0, "reserved_gb": 0.0, "allocated_gb": 0.0})
    for seg in torch.cuda.memory_snapshot():
        pid = seg.get("segment_pool_id", (0, 0))
        name = "default" if tuple(pid) == (0, 0) else f"graph pool {tuple(pid)}"
        p = pools[name]
        p["segments"] += 1
        p["reserved_gb"] += seg["total_size"] / GB
        p["allocated_gb"] += seg["allocated_size"] / GB
    return {k: {kk: round(v, 3) if isinstance(v, float) else v for kk, v in p.items()} for k, p in pools.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--loss-chunk", type=int)
    p.add_argument("--attention", default="fast")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--variant", default="")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    if args.deterministic:
        enable_determinism()
    variant = parse_variant(args.variant)
    store, _ = build_store(args.model, device="cuda")
    store.pin()
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, device="cuda", attention=args.attention,
                      deterministic=args.deterministic, loss_chunk=args.loss_chunk).replace(**variant)
    torch.cuda.reset_peak_memory_stats()
    trainer = PorosTrainer(store, cfg)
    seconds = [round(trainer.step().seconds, 3) for _ in range(args.steps)]
    torch.cuda.synchronize()
    row = {"model": args.model, "seq_len": args.seq_len, "variant": echo(variant),
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "step_s": seconds,
           "predicted_peak_gb": round(trainer.plan.summary()["peak_vram_bytes"] / GB, 3),
           "plan": {"resident_layers": len(trainer.plan.resident_layers), "block_size": trainer.plan.block_size,
                    "head_resident": trainer.plan.head_resident, "offload_inputs": trainer.plan.offload_inputs,
                    "graph_pool_gb": round(trainer.plan.graph_pool / GB, 3)},
           "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / GB, 3),
           "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / GB, 3),
           "reserved_now_gb": round(torch.cuda.memory_reserved() / GB, 3),
           "allocated_now_gb": round(torch.cuda.memory_allocated() / GB, 3),
           "pools": by_pool(), "counters": {k: v for k, v in trainer.counters().items() if "template" in k or "graph" in k},
           "provenance": provenance()}
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
