"""The closed sets some training settings take their values from, one `str` enum each: a member's value is the word
that flags, matrix files, run files and results rows use. The settings table (poros/settings.py) names the setting
that takes each set."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Attention(str, enum.Enum):
    """SDPA backend applied to every method alike (`default` lets torch choose), or `fa4`: FlashAttention-4's
    kernels where they serve a call, the `fast` list for every other call."""

    DEFAULT = "default"
    MATH = "math"
    CUDNN = "cudnn"
    EFFICIENT = "efficient"
    FLASH = "flash"
    FAST = "fast"  # flash, else memory-efficient, else math: per call, by shape (poros/engine/model/attention.py)
    FA4 = "fa4"  # FlashAttention-4 where it serves a call (causal or unmasked, bf16/fp16), else as fast


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


@dataclass(frozen=True)
class KernelNeeds:
    """What an attention value needs of the machine, declared here and checked before any work: the device
    (a rule of poros/resolve.py, wherever a config is made), and where a run starts on this machine
    (poros/harness/preflight.py `attention_problem`) the GPU's compute capability and the package's module."""

    device: Device
    majors: tuple[int, ...]  # compute capability majors whose kernels the package has
    least: str  # how the message words them
    module: str  # importable where the value runs
    package: str  # what provides the module
    instead: Attention  # the value to use where these needs are not met


ATTENTION_NEEDS: dict[Attention, KernelNeeds] = {
    # FlashAttention-4's SM90 (Hopper) and SM100/SM110 (Blackwell data-center) kernels; SM120 has no
    # deterministic backward, SM8x no FA4 backward at all (poros/engine/model/fa4.py names the version checked)
    Attention.FA4: KernelNeeds(Device.CUDA, (9, 10, 11), "compute capability 9.x (Hopper), 10.x or 11.x (Blackwell "
                               "data-center)", "flash_attn.cute", "flash-attn-4==4.0.0b40", Attention.FAST),
}
