"""Where poros's peak device memory goes: trace every allocation of a trainer and list what is live
at the peak of its last step (a GPU probe, not a test).

    python3 experiments/h200-cuda-graph-memory/memtrace.py qwen3-32b --variants overlap,graphs [--steps 3] [--top 15]
    python3 experiments/h200-cuda-graph-memory/memtrace.py qwen3-32b --variants graphs --compile --attention fast \
        --deterministic --lora-compute bf16      # the settings `poros train` takes on CUDA, compiled as a matrix runs
    python3 experiments/h200-cuda-graph-memory/memtrace.py qwen3-32b --plans none,12GB --compile --lora-compute bf16
        # each VRAM budget on the settings `poros train` resolves on CUDA (poros/resolve.py), one trainer after another

With --plans, each line also holds the process's NVML peak over the trainer's life (what a budget counts), the
allocator's reserved peaks, and, where the trainer fails (a budget's cap), the error and what was allocated then.

Recording starts before the trainer is made, so everything the trainer allocates is attributed to
the Python line that allocated it (the store itself lives in host memory). Per variant, one JSON
line: the peak of the last step, the live total at its start, and the top allocation sites at the
peak with their sizes; also how much of the allocated memory sits in CUDA-graph pools; and the peak of the whole
run (its first steps capture the templates and compile) with its sites, beside the plan's predicted parts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from collections import Counter

import torch

from poros.store.build import build_store
from poros.config import TrainConfig
from poros.engine.methods.executor import PorosTrainer
from poros.engine.runtime.nvml import NvmlPeak
from poros.resolve import with_defaults
from poros.sizes import parse_size

MAX_ENTRIES = 2_000_000


def site(frames: list[dict], depth: int = 3) -> str:
    """The innermost `depth` frames outside torch of an allocation."""
    mine = [f for f in frames if "/torch/" not in f["filename"]][:depth]
    return " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in mine) or "?"


def analyse(trace: list[dict], step_start: int, top: int) -> dict:
    """Live bytes over the trace; the live set at the peak after `step_start` grouped by site."""
    live: dict[int, dict] = {}
    cur = peak = 0
    peak_at = None
    start_live = None
    for n, e in enumerate(trace):
        if n == step_start:
            start_live = cur
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
        if n >= step_start and cur > peak:
            peak, peak_at = cur, n
    live.clear()
    for e in trace[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    groups: Counter = Counter()
    counts: Counter = Counter()
    for e in live.values():
        key = site(e.get("frames") or [])
        groups[key] += e["size"]
        counts[key] += 1
    at = site(trace[peak_at].get("frames") or [])
    return {"traced_peak_gb": round(peak / 1e9, 3), "traced_at_step_start_gb": round((start_live or 0) / 1e9, 3),
            "peak_reached_at": at,
            "top": [{"site": k, "gb": round(v / 1e9, 4), "n": counts[k]} for k, v in groups.most_common(top)]}


def live_blocks(snapshot: dict, top: int) -> list[dict]:
    """Allocated blocks now, grouped by pool (default or a graph pool) and allocation site."""
    groups: Counter = Counter()
    counts: Counter = Counter()
    for seg in snapshot["segments"]:
        pool = "graph" if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0) else "default"
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                key = pool + " | " + site(b.get("frames") or [], 4)
                groups[key] += b["size"]
                counts[key] += 1
    return [{"site": k, "gb": round(v / 1e9, 4), "n": counts[k]} for k, v in groups.most_common(top)]


def pools(snapshot: dict) -> dict:
    """Allocated and reserved bytes in the default pool and in private (CUDA-graph) pools."""
    out = {"default_allocated_gb": 0.0, "private_allocated_gb": 0.0, "private_reserved_gb": 0.0}
    for seg in snapshot["segments"]:
        private = tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
        active = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        out["private_allocated_gb" if private else "default_allocated_gb"] += active / 1e9
        if private:
            out["private_reserved_gb"] += seg["total_size"] / 1e9
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--variants", default="overlap,graphs")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--attention", default="math")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--lora-compute", default="fp32")
    p.add_argument("--plans", default=None, help="VRAM budgets (none: every layer streamed), comma-separated")
    p.add_argument("--stream-buffers", type=int, default=2)
    args = p.parse_args()
    store, _ = build_store(args.model, device="cuda", progress=None)
    if args.plans:
        for budget in args.plans.split(","):
            trace_plan(store, args, budget)
        return
    for v in args.variants.split(","):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        cfg = TrainConfig(model=args.model, seq_len=512, device="cuda", attention=args.attention,
                          overlap_backward=v == "overlap", cuda_graphs=v == "graphs", compile=args.compile,
                          deterministic=args.deterministic, lora_compute=args.lora_compute)
        trainer = PorosTrainer(store, cfg)
        for _ in range(args.steps - 1):
            trainer.step()
        torch.cuda.synchronize()
        whole = {"whole_run_max_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
                 "whole_run_max_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 3),
                 "predicted": {k: round(b / 1e9, 3) for k, b in trainer.plan.memory.parts().items()},
                 "whole_run": analyse(torch.cuda.memory._snapshot()["device_traces"][0], 0, args.top)}
        mark = len(torch.cuda.memory._snapshot()["device_traces"][0])
        torch.cuda.reset_peak_memory_stats()
        trainer.step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][0]
        row = {"model": args.model, "variant": v, "before_trainer_gb": round(before / 1e9, 3),
               "last_step_max_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
               "allocated_after_gb": round(torch.cuda.memory_allocated() / 1e9, 3),
               "trace_entries": len(trace), "trace_full": len(trace) >= MAX_ENTRIES,
               **pools(snap), **analyse(trace, mark, args.top), "live_after": live_blocks(snap, args.top), **whole}
        counters = trainer.counters()
        row["templates"] = {k: counters[k] for k in ("layer_templates", "forward_templates", "graphs_captured",
                                                     "capture_errors") if k in counters}
        print(json.dumps(row), flush=True)
        trainer.close()
        del trainer, snap, trace
        gc.collect()
        torch.cuda.empty_cache()


def trace_plan(store, args, budget: str) -> None:
    """One trainer on the CUDA defaults within `budget`: its peaks (NVML, reserved, allocated), the predicted parts
    and the sites live at the last step's peak; on failure the error and the pools then."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    given = {"device": "cuda", "compile": args.compile, "lora_compute": args.lora_compute,
             "vram_budget": None if budget == "none" else parse_size(budget), "stream_buffers": args.stream_buffers}
    values, chosen = with_defaults(given)
    cfg = TrainConfig(model=args.model, seq_len=512, **values)
    row = {"model": args.model, "plan": budget, "device_defaults": list(chosen), "before_trainer_gb": round(before / 1e9, 3),
           "settings": {k: str(v) for k, v in cfg.schedule.items()}}
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    trainer = None
    with NvmlPeak() as nvml:
        try:
            trainer = PorosTrainer(store, cfg)
            row["predicted"] = {k: round(b / 1e9, 3) for k, b in trainer.plan.memory.parts().items()}
            row["predicted_process_gb"] = round(trainer.plan.memory.total / 1e9, 3)
            for n in range(args.steps):
                if n == args.steps - 1:
                    torch.cuda.synchronize()
                    row["max_allocated_before_last_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
                    row["max_reserved_before_last_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 3)
                    mark = len(torch.cuda.memory._snapshot()["device_traces"][0])
                    torch.cuda.reset_peak_memory_stats()
                trainer.step()
                torch.cuda.synchronize()
            row["last_step_max_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
            row["last_step_max_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 3)
            snap = torch.cuda.memory._snapshot()
            row.update(pools(snap), **analyse(snap["device_traces"][0], mark, args.top))
            row["live_after"] = live_blocks(snap, args.top)
            row["counters"] = {k: v for k, v in trainer.counters().items() if isinstance(v, (int, float))}
        except Exception as e:  # a budget's cap: what was held when it refused
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            snap = torch.cuda.memory._snapshot()
            row.update(pools(snap))
            row["live_at_error"] = live_blocks(snap, args.top)
            row["allocated_at_error_gb"] = round(torch.cuda.memory_allocated() / 1e9, 3)
            row["reserved_at_error_gb"] = round(torch.cuda.memory_reserved() / 1e9, 3)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    row["nvml_peak_gb"] = None if nvml.peak is None else round(nvml.peak / 1e9, 3)
    row["nvml_source"] = nvml.source
    print(json.dumps(row), flush=True)
    if trainer is not None:
        trainer.close()
    del trainer
    gc.collect()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
