"""`poros train`: fine-tune a checkpoint folder on JSON Lines data; writes a peft adapter."""

from __future__ import annotations

import argparse
import enum
import shlex
import signal
import sys
import threading
from pathlib import Path

from poros.cli.parity import train_config
from poros.engine.distributed import close_world, init_world, launched
from poros.engine.methods import FINETUNE_METHODS
from poros.finetune.recipe import FinetuneConfig, finetune
from poros.settings import BY_NAME, add_arguments, from_arguments

EPILOG = """examples:
  poros train --model ./Qwen3-32B --data chats.jsonl --out runs/qwen3 --steps 1000 --device cuda --attention math
  poros train --model ./Qwen3-32B --data chats.jsonl --out runs/qwen3 --steps 2000 --device cuda --attention math --resume
  poros train --model ./Qwen2.5-72B --data chats.jsonl --out runs/q72 --steps 500 --device cuda --vram-budget 24GB
  poros train --model ./tiny --data data.jsonl --out runs/tiny --steps 20 --seq-len 64 --lr 3e-3 --device cpu

--data: one JSON object per line, {"text": "..."} or {"messages": [{"role": "user", "content": "..."}, ...]}
(rendered with the tokenizer's chat template, loss on the assistant turns only; roles system, user, assistant,
tool, with spellings such as Assistant, gpt, bot, human mapped to them). UTF-8, plain or gzip-compressed.
The tokens are kept in .poros-cache/ beside the data file, so a resumed run does not tokenize again.
RUN_DIR gets adapter/ (peft: PeftModel.from_pretrained(base_model, "RUN_DIR/adapter")), checkpoint/,
log.csv, loss.png and config.json. Ctrl-C or SIGTERM saves a checkpoint and prints the command that resumes;
--resume refuses settings that would change the result and accepts new schedule settings.
Prints one JSON line at the end; exit 0 when done, 130 when stopped by Ctrl-C (143: SIGTERM), 2 on bad input.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a checkpoint on your data (LoRA adapter out)", epilog=EPILOG)
    p.add_argument("--model", required=True, help="checkpoint folder: bf16/fp16 safetensors or a bitsandbytes NF4 "
                                                  "checkpoint, with its tokenizer files")
    p.add_argument("--data", required=True, help="JSON Lines training data")
    p.add_argument("--out", required=True, help="run folder (new or empty, or the run to --resume)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps in all (a resumed run continues to it)")
    p.add_argument("--method", choices=[m.value for m in FINETUNE_METHODS], default="poros",
                   help="poros (NF4 weights streamed from host memory) or resident (ordinary QLoRA) "
                        "(default: poros)")
    p.add_argument("--save-every", type=int, default=100, metavar="N",
                   help="checkpoint every N steps (0: only at the end and on Ctrl-C) (default: 100)")
    p.add_argument("--eval-data", help="JSON Lines data whose mean loss is reported at every checkpoint "
                                       "(default: none)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    add_arguments(p)  # the settings table's flags (poros/settings.py); --seed also orders the data
    p.set_defaults(run=run)


def finetune_config(args):
    """The validated FinetuneConfig of the parsed arguments."""

    return FinetuneConfig(train=train_config(args), data=args.data, out=args.out, steps=args.steps,
                          method=args.method, save_every=args.save_every, eval_data=args.eval_data)


def resume_command(args, device: str) -> str:
    """The command that continues this run: its own flags, the device spelled out, plus --resume."""


    as_module = sys.argv and Path(sys.argv[0]).parent.name == "poros" and Path(sys.argv[0]).name == "__main__.py"
    argv = ["python", "-m", "poros"] if as_module else ["poros"]
    if launched():  # the same ranks again
        import os

        argv = ["torchrun", "--nproc-per-node", os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]), "-m",
                "poros"]
    argv += ["train", "--model", args.model, "--data", args.data, "--out", args.out, "--steps", str(args.steps),
             "--method", args.method, "--save-every", str(args.save_every)]
    if args.eval_data is not None:
        argv += ["--eval-data", args.eval_data]
    for name, value in {**from_arguments(args), "device": device}.items():
        flag = BY_NAME[name].flag
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, value.value if isinstance(value, enum.Enum) else repr(value) if isinstance(value, float)
                     else ",".join(value) if isinstance(value, (list, tuple))
                     else str(value)]
    return shlex.join([*argv, "--resume"])


def _terminate(signum, frame):
    raise KeyboardInterrupt  # before the training loop (which saves first), SIGTERM ends the run as Ctrl-C does


def run(args: argparse.Namespace) -> int:
    fc = finetune_config(args)

    world = init_world(fc.train.device.value)
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        summary = finetune(fc, resume=args.resume, resume_command=resume_command(args, fc.train.device.value))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        close_world()
    if world.main:
        print(summary.json(), flush=True)
    return 128 + (summary.signal or signal.SIGINT) if summary.interrupted else 0
