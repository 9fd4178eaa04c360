"""`poros train`: fine-tune a checkpoint folder on your data; writes a peft adapter."""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from poros.engine.parallel.launch import launched
from poros.engine.methods.registry import FINETUNE_METHODS
from poros.errors import PorosError
from poros.paths import path_arg
from poros.finetune.config import RUN_FILE, override_words, parse_overrides, read_run_file, resolve
from poros.harness import preflight as checks
from poros.cli.flags import add_arguments, from_arguments

EPILOG = """examples:
  poros train --model ./Qwen3-32B --data chats.jsonl --out runs/qwen3 --steps 1000
  poros train --config run.yaml                       # the same, from a run file
  poros train --config run.yaml lr=2e-4 steps=2000    # key=value overrides the run file and the flags
  poros train --config runs/qwen3/run.yaml --resume   # continue a run (its resolved configuration)
  poros train --model ./Qwen3-32B --data chats.jsonl --out runs/q --steps 500 --dry-run
  poros train --model ./Qwen2.5-72B --data data/ --out runs/q72 --steps 500 --vram-budget 24GB --eval-split 0.02
  poros train --model ./Qwen3-32B --data chats.jsonl --out runs/dp --steps 1000 --gpus 2
  poros train --model ./tiny --data data.jsonl --out runs/tiny --steps 20 --seq-len 64 --lr 3e-3 --device cpu

On CUDA, settings left unset take the fast exact path: attention fast under strict determinism (exact
and repeatable), CUDA-graph layers and vram_budget auto; the run prints the plan it chose in one line.
On the CPU the defaults below stay.

--data: JSON Lines, one record a line: {"text": "..."}, {"prompt": "...", "completion": "..."} (loss on
the completion only) or {"messages": [{"role": "user", "content": "..."}, ...]} (rendered with the
tokenizer's chat template, loss on the assistant turns only; roles system, user, assistant, tool, with
spellings such as Assistant, gpt, bot, human mapped to them); UTF-8, plain or gzip-compressed. Or what the
`datasets` library reads locally (pip install 'poros[data]'): a .parquet or .arrow file, a folder of them,
or a save_to_disk folder, with the same columns. The tokens are kept in .poros-cache/ beside the data.
RUN_DIR gets adapter/ (peft: PeftModel.from_pretrained(base_model, "RUN_DIR/adapter")), checkpoint/,
log.csv, loss.png, config.json and run.yaml (the resolved configuration). Ctrl-C or SIGTERM saves a
checkpoint and prints the command that resumes; --resume refuses settings that would change the result
and accepts new schedule settings. Then: poros export --merge, poros generate.
Prints one JSON line at the end; exit 0 when done, 130 when stopped by Ctrl-C (143: SIGTERM), 2 on bad input.
"""

RANK_GRACE_S = 60  # after one rank fails, how long the others may take to fail or finish before they are ended


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a checkpoint on your data (LoRA adapter out)", epilog=EPILOG)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="settings by name (lr=1e-4, lora_targets=[q_proj,v_proj]); they override the run file and "
                        "the flags")
    p.add_argument("--config", metavar="RUN_FILE", type=path_arg, help="YAML run file: settings by name, as run.yaml in a run folder "
                                                        "holds them (default: none)")
    p.add_argument("--model", help="checkpoint folder: bf16/fp16 safetensors or a bitsandbytes NF4 checkpoint, with "
                                   "its tokenizer files")
    p.add_argument("--data", type=path_arg, help="training data: JSON Lines, or a Parquet/Arrow file or folder (see below)")
    p.add_argument("-o", "--out", type=path_arg, help="run folder (new or empty, or the run to --resume)")
    p.add_argument("--steps", type=int, help="optimizer steps in all (a resumed run continues to it)")
    p.add_argument("--method", choices=[m.value for m in FINETUNE_METHODS], default=None,
                   help="poros (NF4 weights streamed from host memory) or resident (ordinary QLoRA) "
                        "(default: poros)")
    p.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="checkpoint every N steps (0: only at the end and on Ctrl-C) (default: 100)")
    p.add_argument("--eval-data", help="data whose mean loss is reported at every checkpoint (default: none)")
    p.add_argument("--eval-split", type=float, metavar="SHARE",
                   help="hold out this share of the training records (chosen by --seed) and report their mean loss "
                        "at every checkpoint; they are never trained on (default: none)")
    p.add_argument("--gpus", type=int, metavar="N", help="data-parallel ranks, one per GPU (on the CPU: processes); "
                                                         "each step takes N x batch x grad_accum sequences (default: 1)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the plan, the data's sequences and tokens, and exit "
                                                          "without training or writing the run folder")
    add_arguments(p)  # the settings table's flags (poros/cli/flags.py)
    p.set_defaults(run=run)


def given_values(args) -> dict:
    """Run file, then flags, then key=value words: every setting the command line gives."""
    values = read_run_file(args.config) if args.config else {}
    flags = {k: getattr(args, k) for k in ("model", "data", "out", "steps", "method", "save_every", "eval_data",
                                             "eval_split", "gpus")}
    values.update({k: v for k, v in {**flags, **from_arguments(args)}.items() if v is not None})
    values.update(parse_overrides(args.overrides))
    return values


def finetune_config(args):
    """The validated FinetuneConfig the command line asks for, and the settings that took CUDA's defaults."""
    import torch

    return resolve(given_values(args), cuda_available=torch.cuda.is_available())


def resume_command(out: Path) -> str:
    """The command that continues the run in `out`: its resolved configuration, plus --resume."""
    as_module = sys.argv and Path(sys.argv[0]).parent.name == "poros" and Path(sys.argv[0]).name == "__main__.py"
    argv = ["python", "-m", "poros"] if as_module else ["poros"]
    return shlex.join([*argv, "train", "--config", str(out / RUN_FILE), "--resume"])


def _terminate(signum, frame):
    raise KeyboardInterrupt  # before the training loop (which saves first), SIGTERM ends the run as Ctrl-C does


def run(args: argparse.Namespace) -> int:
    from poros.engine.parallel.distributed import close_world, init_world
    from poros.engine.methods.trainer import set_cublas_workspace
    from poros.finetune.recipe import check_paths, finetune

    fc, chosen = finetune_config(args)
    check_paths(fc)
    device = fc.train.device.value
    if not args.dry_run:  # a dry run shows a GPU's plan on any machine
        checks.check_device(device, "device")
        checks.check_attention(fc.train.attention, device, "attention")
    if fc.train.deterministic:
        set_cublas_workspace()  # before anything touches CUDA: cuBLAS reads it once per process
    if fc.train.gpus > 1 and not launched() and not args.dry_run:
        checks.check_ranks(fc.train.gpus, device, "gpus")  # before any rank starts
        return run_ranks(override_words(fc) + (["--resume"] if args.resume else []), fc.train.gpus)
    world = init_world(device)
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        summary = finetune(fc, resume=args.resume, resume_command=resume_command(fc.out.absolute()),
                           dry_run=args.dry_run, device_defaults=chosen)
    except PorosError:
        if world.main:
            raise
        return 2  # rank 0 says why, once
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        close_world()
    if world.main and not args.dry_run:
        print(summary.json(), flush=True)
    return 128 + (summary.signal or signal.SIGINT) if summary.interrupted else 0


def run_ranks(words: list[str], ranks: int) -> int:
    """`poros train` on `ranks` processes of this host, started as torchrun starts them (its environment
    variables: RANK, WORLD_SIZE, MASTER_ADDR, ...) but each in a session of its own, so Ctrl-C or SIGTERM
    reaches every rank once, from here: each saves its step and stops (a second one aborts). Returns rank
    0's exit status; a rank that fails ends the others after RANK_GRACE_S."""
    from poros.harness.ranks import free_port, launch_env

    env, port = launch_env(ranks), free_port()
    procs = []
    for r in range(ranks):
        rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(ranks),
                    "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "poros", "train", *words], env=rank_env,
                                      start_new_session=True))

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    held = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        failed_at = None
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > RANK_GRACE_S:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
    finally:
        for s, h in held.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    return codes[0] if codes[0] >= 0 else next((c for c in codes if c > 0), 1)
