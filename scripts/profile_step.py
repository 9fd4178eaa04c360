"""Where a training step's time goes: torch.profiler over one step of each method (a probe, not a test).

    python3 scripts/profile_step.py qwen3-32b [--methods poros,resident] [--attention math] [--top 25]
    python3 scripts/profile_step.py qwen2.5-72b --methods poros --attention fast --deterministic \
        --seq-len 32768 --loss-chunk 4096 --mlp-chunk 4096 --variant offload_inputs=true,vram_budget=40GB
    python3 scripts/profile_step.py qwen2.5-72b --methods poros,unsloth ... --compile --lora-compute bf16

Builds the model once; per method runs one warm-up step and one timed step (`s_per_step_timed`: to the device's
end of it), then profiles `--steps` consecutive steps (default 1; several show the steady state, where the host
enqueues a step while the device runs the one before) and prints one JSON line, its figures per step: wall time,
the share of it the GPU spent in compute kernels and in host->device copies (union of intervals, so overlap is not double-counted), kernel launches, device time per kind of
kernel (attention forward and backward, matmuls, NF4 dequantization, copies, the rest), where the link idles and
what the host ran then, the host->device copies by stream (the weights' and the saved inputs' way back), and what
the compute waited for between its kernels (a stream's copy, or the host), and the top kernels by total device
time. --compile and --lora-compute apply to every gated method (Unsloth runs as its
users run it). The warm-up step compiles. --variant takes schedule settings (KEY=VALUE,...). With --out DIR
the full tables are written there too. `unsloth` (GPU only) runs in its own process, as in the matrices, and
profiles its step there. On CPU only the wall time and the operator table mean anything.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from poros.config import Method, TrainConfig
from poros.engine.methods.registry import make_trainer
from poros.harness.profiling import profiled, summarize
from poros.engine.methods.trainer import enable_determinism
from poros.harness.unsloth import measure_unsloth
from poros.settings import schedule_variant
from poros.models.checkpoint import cut_source
from poros.store.build import build_store


def parse_variant(text: str) -> dict:
    """--variant's schedule settings (poros/settings.py `schedule_variant`).

    Raises:
        SystemExit: what is wrong with it.
    """
    try:
        return schedule_variant(text)
    except ValueError as e:
        raise SystemExit(f"--variant: {e}") from None


def echo(variant: dict) -> dict:
    """A variant's settings as rows and logs write them (enums by their value)."""
    return {k: getattr(x, "value", x) for k, x in variant.items()}


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
    p.add_argument("--mlp-chunk", type=int, help="every decoder layer's MLP this many tokens at a time (every method)")
    p.add_argument("--attention-chunk", type=int,
                   help="every decoder layer's attention projections and norms this many tokens at a time (every method)")
    p.add_argument("--compile", action="store_true", help="regionally compiled decoder layers (every method)")
    p.add_argument("--compile-mlp", action=argparse.BooleanOptionalAction, default=True,
                   help="with --compile, each layer's MLP compiled with it (--no-compile-mlp: eager between its "
                        "compiled parts)")
    p.add_argument("--lora-compute", default="fp32", help="fp32 or bf16 LoRA matmuls (every method)")
    p.add_argument("--variant", default="", help="schedule settings for poros, KEY=VALUE,... (e.g. cuda_graphs=true,vram_budget=24GB)")
    p.add_argument("--layers", type=int, help="the model cut to its first N decoder layers (ModelShape.cut): one "
                   "layer's time at a long sequence in seconds a step")
    p.add_argument("--steps", type=int, default=1,
                   help="consecutive steps profiled, no synchronization between them (the steady state; figures "
                        "per step)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.steps < 1:
        raise SystemExit(f"--steps: expected at least 1, got {args.steps}")
    if args.deterministic:
        enable_determinism()
    variant = parse_variant(args.variant)
    from poros.provenance import provenance
    try:
        source = args.model if args.layers is None else cut_source(args.model, args.layers)
    except ValueError as e:
        raise SystemExit(f"--layers: {e}") from None
    store, _ = build_store(source, device=args.device)
    if args.device == "cuda":
        store.pin()
    for method in args.methods.split(","):
        cfg = TrainConfig(model=args.model, seq_len=args.seq_len, block_size=args.block_size, device=args.device,
                          attention=args.attention, deterministic=args.deterministic, loss_chunk=args.loss_chunk,
                          mlp_chunk=args.mlp_chunk,
                          attention_chunk=args.attention_chunk, compile=args.compile,
                          compile_mlp=args.compile_mlp or not args.compile, lora_compute=args.lora_compute)
        head = {"model": args.model, "layers": args.layers, "method": method, "attention": args.attention,
                "seq_len": args.seq_len,
                "compile": cfg.compile, "compile_mlp": cfg.compile_mlp, "lora_compute": cfg.lora_compute.value,
                "mlp_chunk": cfg.mlp_chunk,
                "attention_chunk": cfg.attention_chunk,
                "variant": echo(variant) if Method(method) is Method.POROS else {}}
        if Method(method) is Method.UNSLOTH:  # in its own process (it patches libraries globally)
            print(json.dumps({**head, **profile_unsloth(store, cfg, args.out)}), flush=True)
            continue
        if Method(method) is Method.POROS:
            cfg = cfg.replace(**variant)
        trainer = make_trainer(Method(method), store, cfg)
        trainer.step()  # warm-up: allocator, cuBLAS handles, lazy init
        timed = synced(trainer.step, args.device)[1]  # a step without the profiler's overhead, to the device's end
        steps = functools.partial(consecutive, trainer, args.steps)
        (result, wall), prof = profiled(functools.partial(synced, steps, args.device), args.device)
        row = {**head, **summarize(prof, wall, args.top, steps=args.steps), "s_per_step_timed": round(timed, 4),
               "counters": result.counters,
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


def consecutive(trainer, n: int):
    """`n` steps of `trainer` one after another; the last one's result."""
    for _ in range(n):
        result = trainer.step()
    return result


def synced(run, device: str):
    """(`run()`'s result, the seconds from its start to the device's end of the work it enqueued)."""
    t0 = time.perf_counter()
    result = run()
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - t0


def profile_unsloth(store, cfg: TrainConfig, out: Path | None) -> dict:
    """Unsloth's child process: one warm-up step, one timed, then one profiled; its summary."""
    path = (out or Path(tempfile.mkdtemp())) / f"{cfg.model}-unsloth.json"
    record = measure_unsloth(store, cfg, steps=1, passes=1, warmup=1, profile=path)
    return {**json.loads(path.read_text()), "s_per_step_timed": record["s_per_step_median"],
            "unsloth_version": record.get("unsloth_version")}


if __name__ == "__main__":
    main()
