"""The training settings, each declared once.

Every setting of a run is one `Setting` row below. `TrainConfig` validates with it, `poros parity`,
`poros plan` and `poros train` build their flags from it, matrix files accept its names as keys
(schedule settings also under `model_overrides`), results rows record it and the report's
configuration table labels it. A setting is one of three kinds:

- COMPUTED: what is computed (model input shape, LoRA, optimizer, attention, determinism). Every
  method of a cell shares these, and parity compares runs that agree on them.
- SCHEDULE: how poros schedules the same computation (block size, budget, overlap, graphs,
  accumulation order). A matrix may change them per model; they never change a result bit.
- RUN: where and from what (device, seeds, pinning); recorded, not compared.

A row's checker (poros/checkers.py) checks and coerces its values; the closed sets of values are the enums of
poros/choices.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from poros.checkers import (
    dropout_share,
    flag,
    flag_or_auto,
    module_names,
    non_negative_int,
    non_negative_number,
    one_of,
    optional_count,
    optional_count_or_auto,
    optional_positive_int,
    optional_positive_number,
    optional_size,
    positive_int,
    positive_number,
    seed_int,
    sequence_length,
    stream_buffer_count,
)
from poros.choices import Accumulation, Attention, Device, LoRACompute, LRSchedule, Placement
from poros.sizes import AUTO, format_size

COMPUTED, SCHEDULE, RUN = "computed", "schedule", "run"

LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Setting:
    """One training setting: its name (config field, matrix key, results key), default, kind, checker,
    the help of its command-line flag and the label of its row in a report's configuration table."""

    name: str
    default: object
    kind: str
    check: Callable
    help: str
    label: str
    cli: bool = True  # a flag of `poros parity/plan/train`
    metavar: str | None = None
    gpu_only: bool = False  # means nothing without a device (CPU reports leave it out)
    default_help: str | None = None  # how --help words the default, where its value alone says too little
    report_default: bool = True  # False: a report's configuration table names it only where a run changed it

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_flag(self) -> bool:
        """An on/off setting: `--name` turns it on (auto, where it takes it, is a default's or a file's value)."""
        return self.check in (flag, flag_or_auto)

    @property
    def type(self):
        """The type of the setting's values, as its checker returns them (its TrainConfig field's type)."""
        return self.check.type

    def value(self, v):
        """`v` checked and coerced; raises ValueError naming what was expected."""
        return self.check(v)

    def show(self, v) -> str:
        """How a value reads in a report."""
        if v is None:
            return "none"
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, bool):
            return "on" if v else "off"
        if self.check is optional_size:
            return format_size(v)
        if isinstance(v, (list, tuple)):
            return ", ".join(map(str, v))
        return str(v)


SETTINGS: tuple[Setting, ...] = (
    # what is computed
    Setting("seq_len", 512, COMPUTED, sequence_length, "tokens per sequence", "Sequence length"),
    Setting("batch_size", 1, COMPUTED, positive_int, "sequences per micro-batch", "Batch size"),
    Setting("grad_accum", 1, COMPUTED, positive_int, "micro-batches per optimizer step", "Gradient accumulation"),
    Setting("lora_rank", 16, COMPUTED, positive_int, "LoRA rank", "LoRA rank"),
    Setting("lora_alpha", 32, COMPUTED, positive_int, "LoRA alpha", "LoRA alpha"),
    Setting("lora_targets", LORA_TARGETS, COMPUTED, module_names,
            "modules of the decoder layers that get LoRA adapters, by name, comma-separated (the default also takes "
            "fused projections such as qkv_proj, gate_up_proj where a model has them)", "LoRA targets",
            metavar="NAMES"),
    Setting("lr", 1e-4, COMPUTED, positive_number, "AdamW learning rate", "Learning rate"),
    Setting("lr_schedule", LRSchedule.CONSTANT, COMPUTED, one_of(LRSchedule),
            "learning rate over the run after the warm-up: constant, linear or cosine (both decay to 0 at "
            "decay_steps)", "LR schedule", report_default=False),
    Setting("warmup_steps", 0, COMPUTED, non_negative_int,
            "optimizer steps of linear warm-up from 0 to lr (step s of the warm-up takes lr x s / warmup_steps)",
            "Warm-up steps", metavar="STEPS", report_default=False),
    Setting("decay_steps", None, COMPUTED, optional_positive_int,
            "the optimizer step at which linear and cosine reach 0 (and stay)", "LR decay steps", metavar="STEPS",
            default_help="poros train: --steps; elsewhere required by linear and cosine", report_default=False),
    Setting("weight_decay", 0.0, COMPUTED, non_negative_number, "AdamW's decoupled weight decay", "Weight decay",
            report_default=False),
    Setting("max_grad_norm", None, COMPUTED, optional_positive_number,
            "clip the LoRA gradients to this global L2 norm before each optimizer step (after the data-parallel "
            "reduction of the gradients)", "Gradient clipping (global norm)", metavar="NORM", default_help="none: no clipping",
            report_default=False),
    Setting("lora_dropout", 0.0, COMPUTED, dropout_share,
            "dropout on the LoRA input; each mask is drawn from (seed, step, micro-batch, module), so every method "
            "and every recompute draws the same one", "LoRA dropout", metavar="P", report_default=False),
    # fp32 by default: peft's own arithmetic, and that of every run recorded before the setting existed
    Setting("lora_compute", LoRACompute.FP32, COMPUTED, one_of(LoRACompute),
            "dtype of the LoRA matmuls for every method: fp32 (peft's: each activation cast up to the fp32 "
            "adapters) or bf16 (the adapters cast down to the activations' dtype at each call, as Unsloth's "
            "kernels compute; weights, gradients and optimizer state stay fp32)", "LoRA matmul dtype",
            report_default=False),
    Setting("attention", Attention.DEFAULT, COMPUTED, one_of(Attention),
            "SDPA backend for every method: default, math, cudnn, efficient, flash, or fast (flash where a call's "
            "shape allows, else memory-efficient, else math); or fa4: FlashAttention-4's kernels (flash-attn-4 on a CUDA "
            "GPU of compute capability 9.x to 11.x; their deterministic backward under deterministic) where they serve "
            "a call (causal or unmasked, bf16 or fp16, no dropout), fast for every other call (Unsloth keeps its own "
            "attention)", "Attention"),
    Setting("deterministic", False, COMPUTED, flag,
            "strict torch.use_deterministic_algorithms for every method (repeatable attention backward; an op "
            "without a deterministic kernel is an error)", "Deterministic algorithms"),
    Setting("compile", False, COMPUTED, flag,
            "regional compilation for every method alike: each decoder layer runs as torch.compile builds it "
            "(`layer.compile()`); compiled bits differ from eager ones, so compiled runs compare only with compiled "
            "runs", "Compiled decoder layers"),
    Setting("compile_mlp", True, COMPUTED, flag,
            "with compile: each decoder layer's MLP compiled with the rest of the layer; off, the MLP runs eager "
            "between the layer's compiled parts (every method alike), so that with mlp_chunk poros's recompute "
            "computes the MLP's chunks in its backward alone, twice a step where a compiled MLP runs three times",
            "Compiled MLP", report_default=False),
    Setting("gpus", 1, COMPUTED, positive_int,
            "data-parallel ranks on this host, one per GPU (on the CPU: processes); `poros bench` starts them with "
            "torchrun; each trains its share of every step (world_size x grad_accum micro-batches a step)",
            "Data-parallel ranks", cli=False),
    Setting("loss_chunk", None, COMPUTED, optional_positive_int,
            "tokens per chunk of the head: one chunk's logits at a time, recomputed in backward, never the whole "
            "sequence's (the model's loss reduction, bitwise its loss on the CPU; every method alike)",
            "Loss chunk (tokens)", metavar="TOKENS", default_help="none: the model's own head"),
    Setting("mlp_chunk", None, COMPUTED, optional_positive_int,
            "tokens per chunk of every decoder layer's MLP: one chunk's intermediate activations at a time, each "
            "chunk recomputed in backward (every method alike; the MLP's matmuls run on fewer rows, so its bits "
            "may differ from the whole sequence's)", "MLP chunk (tokens)", metavar="TOKENS",
            default_help="none: the whole sequence at once", report_default=False),
    Setting("attention_chunk", None, COMPUTED, optional_positive_int,
            "tokens per chunk of every decoder layer's token-wise modules outside its MLP (the attention's q/k/v/o "
            "projections with their LoRA, the layer's norms): one chunk's saved tensors at a time, each chunk "
            "recomputed in backward, only the attention core over the whole sequence (every method alike; the "
            "matmuls run on fewer rows, so the bits may differ from the whole sequence's)",
            "Attention chunk (tokens)", metavar="TOKENS", default_help="none: the whole sequence at once",
            report_default=False),
    # Off by default: a double-quantized store holds other absmax values (bitsandbytes expands the nested
    # absmax to float32 before each use, which differs slightly from the original), so the weights and every
    # result bit differ from a plain store's; off keeps results comparable with runs recorded without it.
    Setting("double_quant", False, COMPUTED, flag,
            "quantize the NF4 absmax again as bitsandbytes' compress_statistics does (the QLoRA paper's double "
            "quantization: the store and every copy about a twelfth smaller; every method alike; a double-quantized "
            "NF4 checkpoint is then read as it is, without: its absmax expanded to float32)",
            "Double quantization"),
    # how poros schedules it
    Setting("block_size", 4, SCHEDULE, positive_int, "poros: decoder layers per streamed block", "Block size"),
    Setting("stream_buffers", 2, SCHEDULE, stream_buffer_count,
            "poros: device buffers the streamed blocks rotate through (2 to 8); each one more holds another block "
            "at the turn from forward to backward and at the step's end, so fewer copies and less time the link "
            "waits, for one block's memory", "Stream buffers", metavar="N", report_default=False),
    Setting("vram_budget", None, SCHEDULE, optional_size,
            "poros: device memory the process may use as nvidia-smi counts it (24GB, 40GiB, 300MB, or auto: "
            "what the card has free); layers that fit stay resident, the rest stream", "VRAM budget", metavar="SIZE",
            gpu_only=True, default_help="none: stream every layer"),
    Setting("overlap_backward", True, SCHEDULE, flag,
            "poros: enqueue the next layer's recompute while the current layer's backward runs",
            "Overlapped backward"),
    Setting("cuda_graphs", False, SCHEDULE, flag,
            "poros, CUDA only: replay each layer from a CUDA graph shared by the layers at the same "
            "buffer position", "CUDA-graph layers", gpu_only=True),
    Setting("offload_inputs", False, SCHEDULE, flag,
            "poros: keep each layer's saved input in host memory (device->host in forward, back ahead of its "
            "backward); with a VRAM budget the planner turns it on where it needs to, for as few layers as it can",
            "Saved inputs in host memory"),
    Setting("device_inputs", None, SCHEDULE, optional_count,
            "poros, with offload_inputs: the saved inputs of this many recomputed layers, the last ones (the first "
            "their backward needs), stay on the device; the others go through host memory",
            "Saved inputs on the device (layers)", metavar="N", report_default=False,
            default_help="none: every saved input in host memory"),
    Setting("input_stride", 1, SCHEDULE, positive_int,
            "poros: save the input of every N-th recomputed layer only; the backward regenerates the inputs between "
            "from the saved one with the same no-grad forwards the forward pass ran, within the weights already on "
            "the device (fewer saved-input bytes on the device or in host memory, for extra layer forwards)",
            "Saved-input stride (layers)", metavar="N", report_default=False),
    Setting("regenerated_layers", None, SCHEDULE, optional_count_or_auto,
            "poros, with input_stride above 1: the most recomputed layers whose inputs are regenerated, spread evenly "
            "over those input_stride would regenerate (each one a layer forward more a step), or auto: the fewest "
            "that fit the VRAM and host budgets (without a vram_budget, every one)", "Regenerated inputs (layers)",
            metavar="N", report_default=False,
            default_help="none: every one input_stride allows"),
    Setting("host_budget", AUTO, SCHEDULE, optional_size,
            "poros: host memory the NF4 store and the saved inputs kept in host memory may take together (100GB, "
            "120GiB, or auto: /proc/meminfo's MemAvailable, within a cgroup's memory limit, less a tenth of it as headroom, "
            "plus the store the process holds already; none: unchecked); a plan that needs more is refused. "
            "resident_gc_offload: its first saved tensors go to host memory within the same budget, the rest stay "
            "on the device",
            "Host memory budget", metavar="SIZE", gpu_only=True, report_default=False,
            default_help="auto on a CUDA device; unchecked on the CPU, where the device's memory is the host's"),
    Setting("keep_activations", False, SCHEDULE, flag_or_auto,
            "poros: resident layers keep their activations from forward to backward instead of recomputing them "
            "(resident QLoRA's own arithmetic; with CUDA graphs in templates of their own; the plan counts their "
            "memory); true: every resident layer keeps them, a budget holding fewer layers resident for their "
            "memory; auto: where the plan that copies the fewest bytes within the budget keeps every layer "
            "resident, as many of them keep their activations as the rest of the budget holds (spread evenly, at "
            "most kept_layers), and none otherwise: no layer is streamed for them",
            "Kept activations (resident layers)"),
    Setting("keep_attention", False, SCHEDULE, flag,
            "poros, without cuda_graphs: each recomputed layer saves its fused attention's output and log-sum-exp "
            "with its input, and its recompute takes them instead of running attention's forward again (the "
            "backward gets the same tensors; the plan counts their memory)", "Kept attention (recomputed layers)",
            report_default=False),
    Setting("kept_layers", None, SCHEDULE, optional_positive_int,
            "poros, with keep_activations: at most this many resident layers keep their activations, spread "
            "evenly among them; the others recompute", "Kept-activation layers",
            metavar="N", default_help="none: every resident layer"),
    Setting("placement", Placement.TAIL, SCHEDULE, one_of(Placement),
            "poros, with resident layers: tail (the last layers stay) or spread (the streamed layers spread among "
            "the resident ones, so a copy runs behind resident layers' forward as well as their backward)",
            "Resident layer placement"),
    Setting("shard_stream", False, SCHEDULE, flag,
            "poros, data-parallel (gpus > 1): each rank copies 1/gpus of every streamed block from host memory "
            "over its own link and the ranks all-gather the rest (same bytes on every rank, fewer over each link)",
            "Sharded stream (all-gather)", report_default=False),
    Setting("accumulation", Accumulation.LAYER, SCHEDULE, one_of(Accumulation),
            "poros, grad_accum > 1: layer (each block loaded once for all micro-batches) or micro "
            "(each micro-batch through the whole model)", "Accumulation order"),
    # where and from what
    Setting("device", Device.CPU, RUN, one_of(Device), "cpu or cuda", "Device",
            default_help="cuda when available, else cpu"),
    Setting("seed", 0, RUN, seed_int, "seed of the synthetic weights and the LoRA init", "Seed"),
    Setting("data_seed", 1234, RUN, seed_int, "seed of the synthetic data", "Data seed", cli=False),
    Setting("pin_memory", True, RUN, flag, "page-lock the host store (pageable copies are much slower)",
            "Pinned host store"),
)

BY_NAME = {s.name: s for s in SETTINGS}
COMPUTED_NAMES = tuple(s.name for s in SETTINGS if s.kind == COMPUTED)
SCHEDULE_NAMES = tuple(s.name for s in SETTINGS if s.kind == SCHEDULE)


def check_values(values: dict, where: str = "") -> tuple[dict, list[str]]:
    """Check every known setting in `values`; returns (coerced values, problems)."""
    out, problems = {}, []
    for k, v in values.items():
        s = BY_NAME.get(k)
        if s is None:
            continue
        try:
            out[k] = s.value(v)
        except ValueError as e:
            problems.append(f"{where}{k}: {e}")
    return out, problems


def schedule_variant(text: str) -> dict:
    """`cuda_graphs=true,vram_budget=24GB`: schedule settings, comma-separated KEY=VALUE items, checked and coerced
    (true/false flags, whole numbers, the rest as their checkers read text).

    Raises:
        ValueError: naming the item that is not KEY=VALUE of a schedule setting, or each value that is wrong.
    """
    raw = {}
    for item in filter(None, text.split(",")):
        k, eq, v = item.partition("=")
        if not eq or k not in SCHEDULE_NAMES:
            raise ValueError(f"{item!r}: expected KEY=VALUE with KEY one of {', '.join(SCHEDULE_NAMES)}")
        raw[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    values, problems = check_values(raw)
    if problems:
        raise ValueError("; ".join(problems))
    return values
