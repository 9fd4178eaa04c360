"""Compare poros schedules on one model, built once (a GPU probe, not a test or an official result).

    python3 scripts/sweep.py qwen2.5-32b --variants serial,overlap,overlap:0.25 [--resident] \
        [--steps 8 --passes 2 --gate-steps 2] [--attention math] [--out DIR]

A variant is MODE[:F]: MODE `serial`, `overlap` (TrainConfig.overlap_backward) or `graphs`
(TrainConfig.cuda_graphs), F the activation_offload share (default 0). Each variant first passes
the parity gate against a fresh resident trainer (`--gate-steps` steps, torch.equal on
everything), then is timed alone: one warm-up pass and `--passes` passes of `--steps` steps. One JSON line per variant (and one for
resident with `--resident`), appended to DIR/sweep.jsonl too when --out is given. The official
figures come from `poros bench matrix`; this only tells which settings are worth a matrix run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from poros.bench import copy_summary, free_device_memory, measure
from poros.build import build_store
from poros.config import TrainConfig
from poros.parity import run_gate
from poros.residency import PorosTrainer
from poros.train import ResidentTrainer


def parse_variant(text: str) -> dict:
    mode, _, frac = text.partition(":")
    if mode not in ("serial", "overlap", "graphs"):
        raise SystemExit(f"variant {text!r}: expected serial, overlap or graphs, optionally :F (e.g. overlap:0.25)")
    return {"overlap_backward": mode == "overlap", "cuda_graphs": mode == "graphs",
            "activation_offload": float(frac or 0.0)}


def timed(trainer, cfg: TrainConfig, steps: int, passes: int) -> dict:
    free_device_memory()
    if cfg.device.value == "cuda":
        torch.cuda.reset_peak_memory_stats()
    meas = measure(trainer, cfg, steps, passes, warmup=1, label=trainer.method)
    per_step = [t / steps for t in meas.per_pass_s]
    out = {"s_per_step_median": round(statistics.median(per_step), 4), "per_step_by_pass": [round(t, 4) for t in per_step],
           "peak_vram_gb": None if meas.peak_vram_gb is None else round(meas.peak_vram_gb, 3)}
    out.update(copy_summary(meas.counters))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--variants", default="serial,overlap")
    p.add_argument("--resident", action="store_true", help="also time resident QLoRA")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--gate-steps", type=int, default=2)
    p.add_argument("--attention", default="math")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path)
    p.add_argument("--time-failing", action="store_true", help="time a variant even when its gate FAILs")
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variants.split(",") if v]
    store, stats = build_store(args.model, device=args.device, progress=None)
    base = TrainConfig(model=args.model, seq_len=args.seq_len, block_size=args.block_size, device=args.device,
                       attention=args.attention)

    from poros.provenance import provenance

    prov = provenance()  # once: commit, versions, GPU name/UUID (which machine a figure came from)

    def emit(row: dict) -> None:
        row = {"model": args.model, "attention": args.attention, "build_s": round(stats.seconds, 1), **row,
               "provenance": prov}
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            with (args.out / "sweep.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")

    if args.resident:
        trainer = ResidentTrainer(store, base)
        emit({"method": "resident", **timed(trainer, base, args.steps, args.passes)})
        trainer.close()
        del trainer
    for v in variants:
        cfg = base.replace(**v)
        resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg)
        gate = run_gate(resident, poros, args.gate_steps)
        resident.close()
        del resident
        row = {"method": "poros", **v, "offloaded_layers": len(poros.offload_layers), "parity": gate.parity,
               "parity_steps": gate.steps, "tensors_compared": gate.tensors_compared,
               "first_mismatch": gate.first_mismatch, "max_abs_diff": gate.max_abs_diff}
        if gate.ok or args.time_failing:
            row.update(timed(poros, cfg, args.steps, args.passes))
        # also for a FAILing gate: whether the templates were captured, and why not
        row["engine_counters"] = {k: v for k, v in poros.counters().items() if k in (
            "layer_templates", "forward_templates", "template_fallbacks", "graphs_captured", "capture_errors")}
        if poros._templates is not None and poros._templates.errors():
            row["capture_errors"] = poros._templates.errors()
        emit(row)
        poros.close()
        del poros
        free_device_memory()


if __name__ == "__main__":
    main()
