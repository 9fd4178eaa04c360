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
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Callable

COMPUTED, SCHEDULE, RUN = "computed", "schedule", "run"


class Attention(str, enum.Enum):
    """SDPA backend applied to every method alike (`default` lets torch choose)."""

    DEFAULT = "default"
    MATH = "math"
    CUDNN = "cudnn"
    EFFICIENT = "efficient"
    FLASH = "flash"
    FAST = "fast"  # flash, else memory-efficient, else math: per call, by shape (poros/engine/attention.py)


class Device(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


class Accumulation(str, enum.Enum):
    """Order of the micro-batches of one optimizer step (grad_accum > 1) in poros's plan."""

    LAYER = "layer"  # each streamed block loaded once; every micro-batch passes through it
    MICRO = "micro"  # each micro-batch through the whole model in turn (every block loaded per micro-batch)


class Placement(str, enum.Enum):
    """Which layers a plan with resident layers keeps on the device (poros/engine/plan.py)."""

    TAIL = "tail"  # the last layers: used at the turn from forward to backward, never copied
    SPREAD = "spread"  # streamed layers spread among resident ones: each copy also runs behind resident forwards


LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value) -> int | str:
    """A byte count from `24GB`, `40GiB`, `300MB`, `1.5e9` or an integer; `auto` stays `auto`.

    Raises:
        ValueError: naming the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 24GB, 40GiB, 300MB or auto, got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"expected a size > 0, got {value!r}")
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    if text == "auto":
        return "auto"
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([a-z]*)", text)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"expected a size such as 24GB, 40GiB, 300MB or auto, got {value!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise ValueError(f"expected a size > 0, got {value!r}")
    return n


def format_size(n: int | str | None) -> str:
    if n is None:
        return "none"
    if isinstance(n, str):
        return n
    return f"{n / 1e9:.3g} GB" if n >= 10**8 else f"{n / 1e6:.3g} MB"


# --- value checkers: return the coerced value or raise ValueError(what was expected, got what) ----

def positive_int(v):
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"expected an integer > 0, got {v!r}")
    return v


def any_int(v):
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"expected an integer, got {v!r}")
    return v


def positive_number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"expected a number > 0, got {v!r}")
    return float(v)


def flag(v):
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


def one_of(enum_cls: type[enum.Enum]) -> Callable:
    def check(v):
        if isinstance(v, enum_cls):
            return v
        try:
            return enum_cls(v)
        except ValueError:
            raise ValueError(f"expected one of {', '.join(m.value for m in enum_cls)}, got {v!r}") from None

    return check


def module_names(v):
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(t, str) and t for t in v):
        raise ValueError(f"expected a non-empty list of module names, got {v!r}")
    return tuple(v)


def optional_size(v):
    return None if v is None or v == "none" else parse_size(v)


def optional_positive_int(v):
    if v is None or v == "none":
        return None
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"expected an integer > 0 or none, got {v!r}")
    return v


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
    quiet: bool = False  # a report leaves it out where every row has its default

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

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
    Setting("seq_len", 512, COMPUTED, positive_int, "tokens per sequence", "Sequence length"),
    Setting("batch_size", 1, COMPUTED, positive_int, "sequences per micro-batch", "Batch size"),
    Setting("grad_accum", 1, COMPUTED, positive_int, "micro-batches per optimizer step", "Gradient accumulation"),
    Setting("lora_rank", 16, COMPUTED, positive_int, "LoRA rank", "LoRA rank"),
    Setting("lora_alpha", 32, COMPUTED, positive_int, "LoRA alpha", "LoRA alpha"),
    Setting("lora_targets", LORA_TARGETS, COMPUTED, module_names, "modules that get LoRA adapters", "LoRA targets",
            cli=False),
    Setting("lr", 1e-4, COMPUTED, positive_number, "AdamW learning rate", "Learning rate"),
    Setting("attention", Attention.DEFAULT, COMPUTED, one_of(Attention),
            "SDPA backend for every method: default, math, cudnn, efficient, flash, or fast (flash where a call's "
            "shape allows, else memory-efficient, else math)", "Attention"),
    Setting("deterministic", False, COMPUTED, flag,
            "strict torch.use_deterministic_algorithms for every method (repeatable attention backward; an op "
            "without a deterministic kernel is an error)", "Deterministic algorithms"),
    Setting("gpus", 1, COMPUTED, positive_int,
            "data-parallel ranks on this host, one per GPU (on the CPU: processes); `poros bench` starts them with "
            "torchrun; each trains its share of every step (world_size x grad_accum micro-batches a step)",
            "Data-parallel ranks", cli=False),
    Setting("loss_chunk", None, COMPUTED, optional_positive_int,
            "tokens per chunk of the head: one chunk's logits at a time, recomputed in backward, never the whole "
            "sequence's (the model's loss reduction, bitwise its loss on the CPU; every method alike) "
            "(none: the model's own head)", "Loss chunk (tokens)", metavar="TOKENS"),
    # how poros schedules it
    Setting("block_size", 4, SCHEDULE, positive_int, "poros: decoder layers per streamed block", "Block size"),
    Setting("vram_budget", None, SCHEDULE, optional_size,
            "poros: device memory the plan may use (24GB, 40GiB, 300MB or auto); layers that fit stay "
            "resident, the rest stream (default: stream every layer)", "VRAM budget", metavar="SIZE", gpu_only=True),
    Setting("overlap_backward", True, SCHEDULE, flag,
            "poros: enqueue the next layer's recompute while the current layer's backward runs",
            "Overlapped backward"),
    Setting("cuda_graphs", False, SCHEDULE, flag,
            "poros, CUDA only: replay each layer from a CUDA graph shared by the layers at the same "
            "buffer position", "CUDA-graph layers", gpu_only=True),
    Setting("offload_inputs", False, SCHEDULE, flag,
            "poros: keep each layer's saved input in host memory (device->host in forward, back ahead of its "
            "backward); with a VRAM budget the planner turns it on where it needs to", "Saved inputs in host memory"),
    Setting("keep_activations", False, SCHEDULE, flag,
            "poros: resident layers keep their activations from forward to backward instead of recomputing them "
            "(resident QLoRA's own arithmetic; with CUDA graphs in templates of their own; the plan counts their "
            "memory)", "Kept activations (resident layers)"),
    Setting("kept_layers", None, SCHEDULE, optional_positive_int,
            "poros, with keep_activations: at most this many resident layers keep their activations, spread "
            "evenly among them; the others recompute (none: every resident layer)", "Kept-activation layers",
            metavar="N"),
    Setting("placement", Placement.TAIL, SCHEDULE, one_of(Placement),
            "poros, with resident layers: tail (the last layers stay) or spread (the streamed layers spread among "
            "the resident ones, so a copy runs behind resident layers' forward as well as their backward)",
            "Resident layer placement"),
    Setting("shard_stream", False, SCHEDULE, flag,
            "poros, data-parallel (gpus > 1): each rank copies 1/gpus of every streamed block from host memory "
            "over its own link and the ranks all-gather the rest (same bytes on every rank, fewer over each link)",
            "Sharded stream (all-gather)", quiet=True),
    Setting("accumulation", Accumulation.LAYER, SCHEDULE, one_of(Accumulation),
            "poros, grad_accum > 1: layer (each block loaded once for all micro-batches) or micro "
            "(each micro-batch through the whole model)", "Accumulation order"),
    # where and from what
    Setting("device", Device.CPU, RUN, one_of(Device), "cpu or cuda (default: cuda when available)", "Device"),
    Setting("seed", 0, RUN, any_int, "seed of the synthetic weights and the LoRA init", "Seed"),
    Setting("data_seed", 1234, RUN, any_int, "seed of the synthetic data", "Data seed", cli=False),
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


def add_arguments(parser, kinds=(COMPUTED, SCHEDULE, RUN), defaults: dict | None = None) -> None:
    """Command-line flags for the settings of `kinds` (each flag's default is None: unset)."""
    for s in SETTINGS:
        if not s.cli or s.kind not in kinds:
            continue
        shown = (defaults or {}).get(s.name, s.default)
        help_ = f"{s.help} (default: {s.show(shown) if shown is not None else 'none'})"
        if s.check is flag:
            parser.add_argument(s.flag, dest=s.name, default=None, action="store_const", const=True, help=help_)
            if s.default:  # a flag on by default gets a --no- form
                parser.add_argument("--no-" + s.flag[2:], dest=s.name, action="store_const", const=False,
                                    help=f"turn off {s.flag}")
        else:
            parser.add_argument(s.flag, dest=s.name, default=None, metavar=s.metavar or s.name.upper(),
                                type=int if s.check in (positive_int, any_int) else
                                float if s.check is positive_number else str, help=help_)


def from_arguments(args) -> dict:
    """The settings given on the command line (flags left unset are absent)."""
    return {s.name: getattr(args, s.name) for s in SETTINGS if getattr(args, s.name, None) is not None}
