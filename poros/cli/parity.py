"""`poros parity`: train a reference (resident QLoRA) and poros side by side, compare every tensor with
torch.equal."""

from __future__ import annotations

import argparse
import sys

from poros import resolve
from poros.config import Method, TrainConfig
from poros.engine.methods.registry import METHODS
from poros.errors import ConfigError
from poros.harness import preflight
from poros.cli.flags import add_arguments, from_arguments
from poros.settings import COMPUTED, RUN, SCHEDULE

EPILOG = """examples:
  poros parity --model tiny-qwen3 --steps 3 --block-size 2 --seq-len 128
  poros parity --model tiny-gemma3 --seq-len 128 --grad-accum 4 --vram-budget 30MB
  poros parity --model qwen2.5-72b --device cuda --seq-len 512 --steps 2 --vram-budget 24GB
  poros parity --model qwen3-32b --device cuda --attention math --cuda-graphs
  poros parity --model qwen3-32b --device cuda --control   # resident vs resident: is this stack repeatable?
  poros parity --model qwen3-32b --device cuda --attention flash --deterministic --control
  poros parity --model qwen3-32b --device cuda --attention flash --deterministic --method resident_gc
  poros parity --model qwen2.5-72b --device cuda --attention flash --deterministic --seq-len 16384 \\
      --gate resident_gc --sequential --vram-budget 24GB --offload-inputs --cuda-graphs --steps 2
  poros parity --model qwen2.5-72b --device cuda --attention fast --deterministic --seq-len 65536 \\
      --loss-chunk 4096 --gate resident_gc_offload --sequential --vram-budget 130GB --steps 1
  poros parity --model ./my-checkpoint --device cuda --attention math --grad-accum 2
  torchrun --nproc-per-node 2 -m poros parity --model qwen3-32b --device cuda --cuda-graphs --grad-accum 4
      # data-parallel: poros against resident QLoRA under DistributedDataParallel, every rank gated

Prints one JSON line; exits 0 only on PASS (1 on FAIL, 2 on bad input).
"""


def add_train_args(p: argparse.ArgumentParser, kinds=None) -> None:
    """--model and the settings table's flags (poros/settings.py)."""

    p.add_argument("--model", required=True, help="registered name (see `poros build --list`) or checkpoint folder")
    add_arguments(p, kinds or (COMPUTED, SCHEDULE, RUN))


def train_config(args):
    """The TrainConfig the flags ask for: unset flags take the device's defaults (poros/resolve.py; device: cuda
    when there), but for the VRAM budget, which stays none (every layer streamed) unless given: parity and plan look
    at the streamed schedule unless asked about a budget."""
    import torch

    values = from_arguments(args)
    values.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    values, _ = resolve.with_defaults(values, leave=("vram_budget",))
    return TrainConfig.from_settings(values, model=args.model)


def add_parser(sub) -> None:
    held = [m.value for m, s in METHODS.items() if s.gated and s.in_process]
    references = [m.value for m, s in METHODS.items() if s.reference]
    p = sub.add_parser("parity", help="bitwise parity gate: resident vs poros", epilog=EPILOG)
    add_train_args(p)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default 3)")
    p.add_argument("--method", default="poros", choices=held,
                   help="the method held to the reference (default poros; resident_gc: is gradient checkpointing "
                        "exact here?)")
    p.add_argument("--gate", default="resident", choices=references,
                   help="the reference: resident QLoRA (default) or resident_gc, resident with gradient "
                        "checkpointing, where resident does not fit (long context), or resident_gc_offload, its "
                        "layer inputs in host memory, where resident_gc does not fit either")
    p.add_argument("--control", action="store_true",
                   help="compare the reference with a second run of itself: is this stack repeatable at all?")
    p.add_argument("--sequential", action="store_true",
                   help="run the reference first and record its states in host memory, then the method: for "
                        "settings where the two do not fit the device together")
    p.set_defaults(run=run)


def run(args) -> int:
    from poros.engine.parallel.distributed import close_world, init_world
    from poros.engine.verify.parity import parity

    if args.steps <= 0:
        raise ConfigError([f"steps: expected an integer > 0, got {args.steps}"], "poros parity")


    cfg = train_config(args)
    preflight.check_attention(cfg.attention, cfg.device.value, "attention")
    world = init_world(cfg.device.value)
    try:
        result = parity(cfg, steps=args.steps, progress=sys.stderr.isatty() and world.main, control=args.control,
                        method=Method(args.method), reference=Method(args.gate), sequential=args.sequential,
                        world=world)
    finally:
        close_world()
    if world.main:
        print(result.json(), flush=True)
    return 0 if result.ok else 1
