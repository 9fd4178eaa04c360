"""`poros plan`: the plan poros would run, from the model's shapes alone (no weights built)."""

from __future__ import annotations

from poros.checkers import MAX_COUNT, sequence_length
from poros.cli.parity import train_config
from poros.engine.planning.budget import make_plan
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.inputs import HostMemory
from poros.engine.planning.limits import BUDGET_STEP, SEQ_LEN_STEP, Limit, longest_seq_len, smallest_budget
from poros.engine.planning.memory import resident_memory
from poros.engine.planning.plan import describe
from poros.engine.planning.search import PlanRequest
from poros.errors import CapabilityError, ConfigError
from poros.models.checkpoint import resolve
from poros.models.skeleton import check_lora_rank, check_seq_len
from poros.cli.flags import add_arguments
from poros.sizes import format_size, is_auto, parse_size
from poros.store.host_memory import available_host_memory

EPILOG = """examples:
  poros plan --model qwen2.5-72b
  poros plan --model qwen2.5-72b --vram-budget 24GB
  poros plan --model qwen3-32b --grad-accum 8 --json
  poros plan --model qwen2.5-72b --double-quant            # absmax quantized again: fewer bytes per step
  poros plan --model ./my-checkpoint --seq-len 4096      # config.json alone suffices
  poros plan --model qwen2.5-72b --gpus 2 --shard-stream  # bytes each rank copies and gathers
  poros plan --model qwen2.5-72b --seq-len 16384 --attention fast --loss-chunk 4096 --smallest-budget
  poros plan --model qwen2.5-72b --vram-budget 24GB --offload-inputs --loss-chunk 4096 --longest-seq-len
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

--smallest-budget prints the smallest --vram-budget, a multiple of --budget-step, for which the planner
finds a plan on the other settings, and that plan; --longest-seq-len the longest --seq-len, a multiple of
--seq-len-step up to the model's max_position_embeddings, whose plan fits --vram-budget, and that plan.
Both ask the planner's own search at a doubling ladder of values across the range, then bisect at the
edge; the ladder runs past the edge, so that a fit that is not monotone (a value that fits beyond one that
does not) shows, and is named. --json prints the value, every value asked and the plan's summary.
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
    p.add_argument("--smallest-budget", action="store_true",
                   help="find the smallest --vram-budget for which a plan exists on these settings")
    p.add_argument("--longest-seq-len", action="store_true",
                   help="find the longest --seq-len whose plan fits --vram-budget")
    p.add_argument("--budget-step", metavar="SIZE",
                   help=f"granularity of --smallest-budget (default: {flag_size(BUDGET_STEP)})")
    p.add_argument("--seq-len-step", metavar="N", help=f"granularity of --longest-seq-len (default: {SEQ_LEN_STEP})")
    p.set_defaults(run=run)


def search_steps(args) -> tuple[int, int]:
    """(--budget-step in bytes, --seq-len-step in tokens), the defaults where not given, once the search flags
    are checked together.

    Raises:
        ConfigError: listing every flag given wrongly, each with what it takes.
    """
    smallest, longest = args.smallest_budget, args.longest_seq_len
    problems, budget, seq = [], BUDGET_STEP, SEQ_LEN_STEP
    if smallest and longest:
        problems.append("--smallest-budget and --longest-seq-len each search one setting with the other fixed: "
                        "give one of them")
    if smallest and args.vram_budget is not None:
        problems.append("--smallest-budget searches the budget: drop --vram-budget")
    if longest and args.vram_budget is None:
        problems.append("--longest-seq-len finds the longest sequence whose plan fits a budget: give one, e.g. "
                        "--vram-budget 24GB")
    if longest and args.seq_len is not None:
        problems.append("--longest-seq-len searches the sequence length: drop --seq-len")
    if args.budget_step is not None:
        if not smallest:
            problems.append("--budget-step is the granularity of --smallest-budget: give that too, or drop it")
        try:
            budget = parse_size(args.budget_step)
            if is_auto(budget):
                raise ValueError("expected a size such as 100MB or 1GiB, got 'auto'")
        except ValueError as e:
            problems.append(f"--budget-step: {e}")
    if args.seq_len_step is not None:
        if not longest:
            problems.append("--seq-len-step is the granularity of --longest-seq-len: give that too, or drop it")
        text = args.seq_len_step.strip()
        try:
            seq = sequence_length(int(text) if text.isdigit() else text)
        except ValueError as e:
            problems.append(f"--seq-len-step: {e}")
    if problems:
        raise ConfigError(problems, source="poros plan")
    return budget, seq


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args) -> int:
    import json

    budget_step, seq_len_step = search_steps(args)
    if getattr(args, "device", None) is None:
        args.device = "cuda"  # a plan needs no device, only what one costs; `auto` budgets measure it
    cfg = train_config(args)
    source = resolve(cfg.model)
    check_seq_len(source.config, cfg.seq_len)
    check_lora_rank(source.config, cfg.lora_rank, cfg.lora_targets)
    geo = Geometry.of_config(cfg.model, source.config, cfg.lora_targets, cfg.double_quant)
    device = None
    if is_auto(cfg.vram_budget) and cfg.device.value == "cuda":
        import torch  # only `auto` touches the device

        from poros.engine.runtime.nvml import device_memory

        if not torch.cuda.is_available():
            raise CapabilityError("--vram-budget auto measures the free memory of this machine's CUDA GPU, and torch "
                                  "finds none here; give the budget as a size, e.g. --vram-budget 24GB")
        device = device_memory(torch.device("cuda"))
    host = None
    if is_auto(cfg.host_budget) and cfg.device.value == "cuda" and _has_cuda():  # this machine runs it: its memory
        available = available_host_memory()  # the store not built yet
        host = None if available is None else HostMemory(available)
    found, head = {}, None  # a search's findings (--json) and its lines
    if args.smallest_budget:
        limit = smallest_budget(geo, PlanRequest.of_config(cfg, device, host=host), budget_step)
        found = limit_summary(limit, "smallest_vram_budget_bytes", "budget_step_bytes")
        head = smallest_text(geo.name, cfg.seq_len, limit)
    elif args.longest_seq_len:
        top = getattr(source.config, "max_position_embeddings", None) or MAX_COUNT
        limit = longest_seq_len(geo, PlanRequest.of_config(cfg, device, host=host), top, seq_len_step)
        cfg = cfg.replace(seq_len=limit.value)
        found = {**limit_summary(limit, "longest_seq_len", "seq_len_step"), "max_position_embeddings": top}
        head = longest_text(geo.name, limit.plan.budget, top, limit)
    plan = limit.plan if found else make_plan(geo, cfg, device, host=host)
    resident = resident_memory(geo, cfg)
    if args.json:
        summary = {**plan.summary(), "resident_qlora_peak_vram_bytes": resident}
        print(json.dumps({**found, "plan": summary} if found else summary))
    else:
        if head:
            print(head)
        print(describe(plan))
        print(f"  resident QLoRA would need about {resident / 1e9:.2f} GB of tensors")
        if args.ops:
            print("  setup: " + " ".join(map(str, plan.setup)))
            print("  step:  " + " ".join(map(str, plan.step)))
    return 0


def limit_summary(limit: Limit, value: str, step: str) -> dict:
    """What --json prints of a search beside the plan's summary."""
    return {value: limit.value, step: limit.step, "monotone": limit.monotone,
            "out_of_order": [list(p) for p in limit.out_of_order], "tried": [list(t) for t in limit.tried],
            **({"at_top": limit.at_top} if limit.at_top else {})}


def flag_size(n: int) -> str:
    """`n` bytes as --vram-budget takes them, exactly: in the largest unit that leaves at most three decimals."""
    for unit, name in ((10**9, "GB"), (2**30, "GiB"), (10**6, "MB"), (2**20, "MiB"), (10**3, "kB"), (2**10, "KiB")):
        if n >= unit and n * 1000 % unit == 0:
            return f"{n / unit:g}{name}"
    return str(n)


def _checked(limit: Limit, what: str, show) -> str:
    """The line that says where the fit was checked monotone, or where it was not."""
    values = [v for v, _ in limit.tried]
    if limit.monotone:
        return (f"  fit monotone at all {len(values)} {what} asked ({show(values[0])} to {show(values[-1])}: a "
                f"doubling ladder, then bisection in steps of {show(limit.step)})")
    pairs = "; ".join(f"a plan fits at {show(a)} but none at {show(b)}" for a, b in limit.out_of_order)
    return (f"  NOT MONOTONE: {pairs}; the bisection found one edge of the fit, which other edges may lie beyond")


def smallest_text(model: str, seq_len: int, limit: Limit) -> str:
    below = limit.value - limit.step
    return (f"smallest VRAM budget for {model} at seq_len {seq_len}: --vram-budget {flag_size(limit.value)} "
            f"(no plan fits {flag_size(below) if below else 'any smaller multiple of the step'})\n"
            + _checked(limit, "budgets", lambda v: flag_size(v) if v else "0"))


def longest_text(model: str, budget: int, top: int, limit: Limit) -> str:
    beyond = (f"every multiple of {limit.step} up to the model's max_position_embeddings ({top}) fits"
              if limit.at_top else f"no plan fits at {limit.value + limit.step}")
    return (f"longest seq_len for {model} within {format_size(budget)}: --seq-len {limit.value} ({beyond})\n"
            + _checked(limit, "lengths", str))
