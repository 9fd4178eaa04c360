"""Seconds a step of qwen2.5-72b cut to its first layers: poros with and without strict determinism, and Unsloth as
its users run it, one after another in one process on one GPU (a probe, not a test).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 experiments/h200-attention-determinism-64k/cut_step.py --layers 4 \
        --seq-len 65536 --out cut.jsonl

The long-context matrices' settings (compiled layers with the MLP eager, LoRA in bf16, fast attention, 2048-token
loss, MLP and attention-block chunks, serial backward); every layer on the device. Per variant: one untimed step
(it compiles), then `--steps` timed ones; one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from poros.config import Method, TrainConfig
from poros.engine.methods.registry import make_trainer
from poros.engine.methods.trainer import enable_determinism
from poros.finetune.samples import write_jsonl
from poros.harness.unsloth import measure_unsloth
from poros.models.checkpoint import cut_source
from poros.store.build import build_store


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-72b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--variants", default="poros-deterministic,poros,unsloth")
    p.add_argument("--out")
    args = p.parse_args()
    store, _ = build_store(cut_source(args.model, args.layers), device="cuda")
    store.pin()
    base = TrainConfig(model=args.model, seq_len=args.seq_len, device="cuda", attention="fast", compile=True,
                       compile_mlp=False, lora_compute="bf16", loss_chunk=2048, mlp_chunk=2048, attention_chunk=2048,
                       overlap_backward=False)
    rows = []
    for variant in args.variants.split(","):
        deterministic = variant.endswith("-deterministic")
        cfg = base.replace(deterministic=deterministic)
        if variant == "unsloth":
            record = measure_unsloth(store, cfg, steps=1, passes=args.steps, warmup=1)
            seconds = record["per_pass_s"]
        else:
            if deterministic:
                enable_determinism()
            else:
                torch.use_deterministic_algorithms(False)
            trainer = make_trainer(Method.POROS, store, cfg)
            trainer.step()
            seconds = [trainer.step().seconds for _ in range(args.steps)]
            trainer.close()
            del trainer
            torch.cuda.empty_cache()
        row = {"variant": variant, "layers": args.layers, "seq_len": args.seq_len, "s_per_step": seconds,
               "median": statistics.median(seconds), "gpu": torch.cuda.get_device_name()}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out:
            write_jsonl(args.out, rows)  # after each variant: a probe cut off by its limit keeps what it measured


if __name__ == "__main__":
    main()
