"""`poros plan`: the plan poros would run, from the model's shapes alone (no weights built)."""

from __future__ import annotations

from poros.cli.parity import add_train_args, train_config
from poros.engine.plan import Geometry, PlanRequest, describe, make_plan, resident_memory
from poros.models.checkpoint import resolve
from poros.models.skeleton import check_seq_len

EPILOG = """examples:
  poros plan --model qwen2.5-72b
  poros plan --model qwen2.5-72b --vram-budget 24GB
  poros plan --model qwen3-32b --grad-accum 8 --json
  poros plan --model ./my-checkpoint --seq-len 4096      # config.json alone suffices
  poros plan --model qwen2.5-72b --gpus 2 --shard-stream  # bytes each rank copies and gathers

Prints which layers stream and which stay resident, the bytes copied host->device per optimizer
step and the predicted peak device memory by part; --json prints one object (keys include
h2d_bytes_per_step, gathered_bytes_per_step, peak_vram_bytes, resident_layers, streamed_layers,
block_size; with --gpus N --shard-stream the bytes and the peak are each rank's).
A budget below the smallest plan is refused, naming the smallest budget that would work.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="show the plan (residency, bytes per step, predicted peak) before running",
                       epilog=EPILOG)
    add_train_args(p)
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="data-parallel ranks the plan is for (with --shard-stream: each copies 1/N of every "
                        "streamed block and all-gathers the rest; default: 1)")
    p.add_argument("--json", action="store_true", help="print the plan's summary as one JSON object")
    p.add_argument("--ops", action="store_true", help="also list the operations of one optimizer step")
    p.set_defaults(run=run)


def run(args) -> int:
    import json


    if getattr(args, "device", None) is None:
        args.device = "cpu"  # a plan needs no device; `auto` budgets need one (refused on cpu)
    cfg = train_config(args)
    source = resolve(cfg.model)
    check_seq_len(source.config, cfg.seq_len)
    geo = Geometry.of_config(cfg.model, source.config, cfg.lora_targets)
    free = None
    if cfg.vram_budget == "auto" and cfg.device.value == "cuda":
        import torch

        free = torch.cuda.mem_get_info()[0]
    plan = make_plan(geo, cfg, free)
    resident = resident_memory(geo, PlanRequest.of_config(cfg, free))
    if args.json:
        print(json.dumps({**plan.summary(), "resident_qlora_peak_vram_bytes": resident}))
    else:
        print(describe(plan))
        print(f"  resident QLoRA would need about {resident / 1e9:.2f} GB")
        if args.ops:
            print("  setup: " + " ".join(map(str, plan.setup)))
            print("  step:  " + " ".join(map(str, plan.step)))
    return 0
