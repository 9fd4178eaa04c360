"""`poros parity`: train resident and poros side by side, compare every tensor with torch.equal."""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  poros parity --model tiny-qwen3 --steps 3 --block-size 2 --seq-len 128
  poros parity --model qwen2.5-72b --device cuda --seq-len 512 --steps 2
  poros parity --model ./my-checkpoint --device cuda --attention math --grad-accum 2

Prints one JSON line; exits 0 only on PASS (1 on FAIL, 2 on bad input).
"""


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="registered name (see `poros build --list`) or checkpoint folder")
    p.add_argument("--block-size", type=int, default=4, help="decoder layers per streamed block (default 4)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--attention", default="default", help="default, math, cudnn, efficient or flash")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pin", action="store_true", help="do not page-lock the host store (much slower copies)")
    p.add_argument("--activation-offload", type=float, default=0.0, metavar="F",
                   help="poros: share of layers (0-1) whose saved activations go to the host instead of "
                        "being recomputed in backward (default 0)")
    p.add_argument("--serial-backward", dest="overlap_backward", action="store_false",
                   help="poros: recompute and backpropagate layers one after the other on one thread "
                        "(default: the next layer's recompute overlaps the current layer's backward)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="poros, CUDA only (experimental): replay each layer's recompute + backward from a CUDA "
                        "graph shared by the layers at the same buffer position")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms for both methods (repeatable attention backward)")


def train_config(args):
    import torch

    from poros.config import TrainConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return TrainConfig.from_settings(args, model=args.model, device=device, seed=args.seed,
                                     pin_memory=not args.no_pin)


def add_parser(sub) -> None:
    p = sub.add_parser("parity", help="bitwise parity gate: resident vs poros", epilog=EPILOG)
    add_train_args(p)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default 3)")
    p.add_argument("--control", action="store_true",
                   help="compare resident with a second resident run: is this stack repeatable at all?")
    p.set_defaults(run=run)


def run(args) -> int:
    from poros.errors import ConfigError
    from poros.parity import parity

    cfg = train_config(args)
    if args.steps <= 0:
        raise ConfigError([f"steps: expected an integer > 0, got {args.steps}"], "poros parity")
    result = parity(cfg, steps=args.steps, progress=sys.stderr.isatty(), control=args.control)
    print(result.json(), flush=True)
    return 0 if result.ok else 1
