"""`poros plan`: the plan poros would run, from the model's shapes alone (no weights built)."""

from __future__ import annotations

from poros.cli.parity import train_config
from poros.engine.planning.geometry import Geometry
from poros.errors import CapabilityError
from poros.engine.planning.inputs import HostMemory
from poros.engine.planning.memory import resident_memory
from poros.engine.planning.plan import describe
from poros.engine.planning.budget import make_plan
from poros.models.checkpoint import resolve
from poros.models.skeleton import check_seq_len
from poros.settings import add_arguments
from poros.store.host_memory import available_host_memory

EPILOG = """examples:
  poros plan --model qwen2.5-72b
  poros plan --model qwen2.5-72b --vram-budget 24GB
  poros plan --model qwen3-32b --grad-accum 8 --json
  poros plan --model qwen2.5-72b --double-quant            # absmax quantized again: fewer bytes per step
  poros plan --model ./my-checkpoint --seq-len 4096      # config.json alone suffices
  poros plan --model qwen2.5-72b --gpus 2 --shard-stream  # bytes each rank copies and gathers
  poros plan --model qwen2.5-72b --seq-len 32768 --loss-chunk 4096 --vram-budget 40GB --host-budget 110GB
      # saved inputs split: the last layers' on the device, the rest in host memory within 110 GB

Prints which layers stream and which stay resident, the bytes copied host->device per optimizer
step and the predicted peak device memory of the process by part: the allocator's tensors, the CUDA
graphs' pool, the allocator's reserve, the CUDA context and (several ranks) NCCL's buffers. A budget
holds that total, what nvidia-smi shows for the process. --json prints one object (keys include
h2d_bytes_per_step, gathered_bytes_per_step, process_vram_bytes, peak_vram_bytes (the tensors alone),
memory (the parts), resident_layers, streamed_layers, block_size, host_inputs (the layers whose saved
inputs go through host memory), host_bytes (the NF4 store and those inputs); with --gpus N --shard-stream the
bytes and the memory are each rank's). A budget below the smallest plan is refused, naming the smallest budget
that would work, and so is a plan whose saved inputs in host memory, beside the NF4 store, exceed
--host-budget (auto: what this machine has available, from /proc/meminfo, where it has a CUDA GPU to run the
plan; elsewhere unchecked unless given). The plan is for a CUDA device unless --device cpu.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="show the plan (residency, bytes per step, predicted peak) before running",
                       epilog=EPILOG)
    p.add_argument("--model", required=True, help="registered name (see `poros build --list`) or checkpoint folder")
    # a plan needs no device, only what one costs: it is made for a CUDA device unless --device cpu
    add_arguments(p, default_text={"device": "cuda: its costs, no device needed"})
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="data-parallel ranks the plan is for; with --shard-stream each copies 1/N of every "
                        "streamed block and all-gathers the rest (default: 1)")
    p.add_argument("--json", action="store_true", help="print the plan's summary as one JSON object")
    p.add_argument("--ops", action="store_true", help="also list the operations of one optimizer step")
    p.set_defaults(run=run)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args) -> int:
    import json


    if getattr(args, "device", None) is None:
        args.device = "cuda"  # a plan needs no device, only what one costs; `auto` budgets measure it
    cfg = train_config(args)
    source = resolve(cfg.model)
    check_seq_len(source.config, cfg.seq_len)
    geo = Geometry.of_config(cfg.model, source.config, cfg.lora_targets, cfg.double_quant)
    device = None
    if cfg.vram_budget == "auto" and cfg.device.value == "cuda":
        import torch  # only `auto` touches the device

        from poros.engine.nvml import device_memory

        if not torch.cuda.is_available():
            raise CapabilityError("--vram-budget auto measures the free memory of this machine's CUDA GPU, and torch "
                                  "finds none here; give the budget as a size, e.g. --vram-budget 24GB")
        device = device_memory(torch.device("cuda"))
    host = None
    if cfg.host_budget == "auto" and cfg.device.value == "cuda" and _has_cuda():  # this machine runs it: its memory
        available = available_host_memory()  # the store not built yet
        host = None if available is None else HostMemory(available)
    plan = make_plan(geo, cfg, device, host=host)
    resident = resident_memory(geo, cfg)
    if args.json:
        print(json.dumps({**plan.summary(), "resident_qlora_peak_vram_bytes": resident}))
    else:
        print(describe(plan))
        print(f"  resident QLoRA would need about {resident / 1e9:.2f} GB of tensors")
        if args.ops:
            print("  setup: " + " ".join(map(str, plan.setup)))
            print("  step:  " + " ".join(map(str, plan.step)))
    return 0
