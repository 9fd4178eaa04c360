"""Time poros alone on one model and report its peak device memory (a GPU probe, not a test).

    python3 scripts/probe.py qwen2.5-72b [--attention default] [--steps 4] [--method poros]
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from poros.bench import make_trainer
from poros.build import build_store
from poros.config import Method, TrainConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--attention", default="default")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--method", default="poros")
    args = p.parse_args()
    store, stats = build_store(args.model, device="cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cfg = TrainConfig(model=args.model, seq_len=512, block_size=args.block_size, device="cuda", attention=args.attention)
    trainer = make_trainer(Method(args.method), store, cfg)
    steps = [trainer.step() for _ in range(args.steps)]
    torch.cuda.synchronize()
    print(json.dumps({
        "model": args.model, "method": args.method, "attention": args.attention, "build_s": round(stats.seconds, 1),
        "step_s": [round(r.seconds, 4) for r in steps], "loss": [round(r.loss, 4) for r in steps],
        "counters": steps[-1].counters,
        "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
        "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 3),
    }))


if __name__ == "__main__":
    main()
