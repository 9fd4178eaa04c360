"""`poros train`: fine-tune a checkpoint folder on JSON Lines data; writes a peft adapter."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import fields
from pathlib import Path

from poros.config import TrainConfig

EPILOG = """examples:
  poros train --model ./Qwen3-32B --data chats.jsonl --out runs/qwen3 --steps 1000 --device cuda --attention math
  poros train --model ./Qwen3-32B --data chats.jsonl --out runs/qwen3 --steps 2000 --device cuda --attention math --resume
  poros train --model ./tiny --data data.jsonl --out runs/tiny --steps 20 --seq-len 64 --lr 3e-3 --device cpu

--data: one JSON object per line, {"text": "..."} or {"messages": [{"role": "user", "content": "..."}, ...]}
(rendered with the tokenizer's chat template, loss on the assistant turns only).
RUN_DIR gets adapter/ (peft: PeftModel.from_pretrained(base_model, "RUN_DIR/adapter")), checkpoint/,
log.csv, loss.png and config.json. Ctrl-C saves a checkpoint and prints the command that resumes.
Prints one JSON line at the end; exit 0 when done, 130 when stopped by Ctrl-C, 2 on bad input.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a checkpoint on your data (LoRA adapter out)", epilog=EPILOG)
    p.add_argument("--model", required=True, help="checkpoint folder: bf16/fp16 safetensors or a bitsandbytes NF4 "
                                                  "checkpoint, with its tokenizer files")
    p.add_argument("--data", required=True, help="JSON Lines training data")
    p.add_argument("--out", required=True, help="run folder (new or empty, or the run to --resume)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps in all (a resumed run continues to it)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--block-size", type=int, default=4, help="poros: decoder layers per streamed block")
    p.add_argument("--vram-budget", metavar="SIZE", help="device memory the run may use, e.g. 24GB")
    p.add_argument("--method", choices=("poros", "resident"), default="poros")
    p.add_argument("--save-every", type=int, default=100, metavar="N",
                   help="checkpoint every N steps (0: only at the end and on Ctrl-C; default 100)")
    p.add_argument("--eval-data", help="JSON Lines data whose mean loss is reported at every checkpoint")
    p.add_argument("--seed", type=int, default=0, help="LoRA initialisation and data order")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--attention", default="default", help="default, math, cudnn, efficient or flash")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms")
    p.add_argument("--cuda-graphs", action="store_true", help="poros, CUDA only: replay layers from CUDA graphs")
    p.add_argument("--no-pin", action="store_true", help="do not page-lock the host store (much slower copies)")
    p.set_defaults(run=run)


def finetune_config(args):
    """The validated FinetuneConfig of the parsed arguments (every problem at once)."""
    import torch

    from poros.errors import ConfigError
    from poros.finetune import FinetuneConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    extra = {}
    if args.vram_budget is not None:
        if "vram_budget" not in {f.name for f in fields(TrainConfig)}:
            raise ConfigError([f"{args.vram_budget}: not supported yet by this version of poros; leave it out "
                               "(--block-size sets how many layers are on the device)"], "--vram-budget")
        extra["vram_budget"] = args.vram_budget
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, grad_accum=args.grad_accum,
                      lr=args.lr, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, block_size=args.block_size,
                      attention=args.attention, device=device, seed=args.seed, pin_memory=not args.no_pin,
                      deterministic=args.deterministic, cuda_graphs=args.cuda_graphs, **extra)
    return FinetuneConfig(train=cfg, data=args.data, out=args.out, steps=args.steps, method=args.method,
                          save_every=args.save_every, eval_data=args.eval_data)


def resume_command(args, device: str) -> str:
    """The command that continues this run: every setting spelled out, plus --resume."""
    as_module = sys.argv and Path(sys.argv[0]).parent.name == "poros" and Path(sys.argv[0]).name == "__main__.py"
    prog = ["python", "-m", "poros"] if as_module else ["poros"]
    argv = ["train", "--model", args.model, "--data", args.data, "--out", args.out, "--steps", str(args.steps),
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--grad-accum", str(args.grad_accum),
            "--lr", repr(args.lr), "--lora-rank", str(args.lora_rank), "--lora-alpha", str(args.lora_alpha),
            "--block-size", str(args.block_size), "--method", args.method, "--save-every", str(args.save_every),
            "--seed", str(args.seed), "--device", device, "--attention", args.attention]
    for flag, value in (("--eval-data", args.eval_data), ("--vram-budget", args.vram_budget)):
        if value is not None:
            argv += [flag, value]
    argv += [flag for flag, on in (("--deterministic", args.deterministic), ("--cuda-graphs", args.cuda_graphs),
                                   ("--no-pin", args.no_pin)) if on]
    return shlex.join([*prog, *argv, "--resume"])


def run(args: argparse.Namespace) -> int:
    from poros.finetune import finetune

    fc = finetune_config(args)
    summary = finetune(fc, resume=args.resume, resume_command=resume_command(args, fc.train.device.value))
    print(summary.json(), flush=True)
    return 130 if summary.interrupted else 0
