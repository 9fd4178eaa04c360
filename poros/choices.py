"""The closed sets some training settings take their values from, one `str` enum each: a member's value is the word
that flags, matrix files, run files and results rows use. The settings table (poros/settings.py) names the setting
that takes each set."""

from __future__ import annotations

import enum


class Attention(str, enum.Enum):
    """SDPA backend applied to every method alike (`default` lets torch choose)."""

    DEFAULT = "default"
    MATH = "math"
    CUDNN = "cudnn"
    EFFICIENT = "efficient"
    FLASH = "flash"
    FAST = "fast"  # flash, else memory-efficient, else math: per call, by shape (poros/engine/model/attention.py)


class LoRACompute(str, enum.Enum):
    """The dtype of the LoRA adapters' matmuls, for every method alike (poros/engine/model/lora_compute.py)."""

    FP32 = "fp32"  # peft's: each input cast up to the fp32 adapters, the product cast back
    BF16 = "bf16"  # the fp32 adapters cast down to the activations' bf16 at each call


class Device(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


class Accumulation(str, enum.Enum):
    """Order of the micro-batches of one optimizer step (grad_accum > 1) in poros's plan."""

    LAYER = "layer"  # each streamed block loaded once; every micro-batch passes through it
    MICRO = "micro"  # each micro-batch through the whole model in turn (every block loaded per micro-batch)


class Placement(str, enum.Enum):
    """Which layers a plan with resident layers keeps on the device (poros/engine/planning/search.py)."""

    TAIL = "tail"  # the last layers: used at the turn from forward to backward, never copied
    SPREAD = "spread"  # streamed layers spread among resident ones: each copy also runs behind resident forwards


class LRSchedule(str, enum.Enum):
    """How the learning rate moves over a run, after `warmup_steps` of linear warm-up
    (the formulas of Hugging Face's get_{constant,linear,cosine}_schedule_with_warmup;
    poros/engine/methods/schedule.py)."""

    CONSTANT = "constant"
    LINEAR = "linear"  # linearly to 0 at decay_steps
    COSINE = "cosine"  # half a cosine to 0 at decay_steps
