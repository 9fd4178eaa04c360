"""`TrainConfig`: one run's model and settings, a frozen dataclass generated from the settings table
(poros/settings.py): one field per setting, typed as its checker declares, validated once."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import field, make_dataclass
from typing import Callable

from poros.choices import (  # noqa: F401  (re-exported: the config's vocabulary)
    Accumulation,
    Attention,
    Device,
    LoRACompute,
    LRSchedule,
    Placement,
)
from poros.errors import ConfigError
from poros.settings import (  # noqa: F401  (re-exported: the config's vocabulary)
    BY_NAME,
    COMPUTED_NAMES,
    LORA_TARGETS,
    SCHEDULE_NAMES,
    SETTINGS,
    check_values,
)


class Method(str, enum.Enum):
    """How the base weights are held while training (see poros/engine/methods.py)."""

    POROS = "poros"  # NF4 store in host memory, streamed onto the device by a plan
    RESIDENT = "resident"  # ordinary QLoRA: the whole NF4 model on the device
    RESIDENT_GC = "resident_gc"  # resident QLoRA with gradient checkpointing per decoder layer (long context)
    RESIDENT_GC_OFFLOAD = "resident_gc_offload"  # resident_gc, its checkpointed layer inputs in host memory
    UNSLOTH = "unsloth"  # Unsloth's FastLanguageModel, as users run it (GPU only)


class _Config:
    """TrainConfig's behaviour; its fields are the settings table's rows (below)."""

    def __post_init__(self) -> None:
        """Each setting coerced to its type (`24GB` to bytes, `cpu` to Device.CPU) and checked, then the
        settings that constrain each other; raises one ConfigError listing every problem."""
        problems: list[str] = []
        if not isinstance(self.model, str) or not self.model:
            problems.append(f"model: expected a registered name or checkpoint path, got {self.model!r}")
        values, bad = check_values({s.name: getattr(self, s.name) for s in SETTINGS})
        problems += bad
        for k, v in values.items():
            object.__setattr__(self, k, v)
        problems += _combination_problems(self, lambda *names: all(n in values for n in names))
        if problems:
            raise ConfigError(problems, source="TrainConfig")

    def replace(self, **changes) -> TrainConfig:
        """A copy with `changes`, validated as a new config."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """Every setting (enums as their values), as results rows record them."""
        out = {"model": self.model}
        for s in SETTINGS:
            v = getattr(self, s.name)
            out[s.name] = v.value if isinstance(v, enum.Enum) else (list(v) if isinstance(v, tuple) else v)
        return out

    @classmethod
    def from_settings(cls, settings: dict, *, model: str, **extra) -> TrainConfig:
        """From a mapping of setting names (a matrix's, parsed flags); `extra` adds or overrides."""
        values = {k: v for k, v in settings.items() if k in BY_NAME}
        return cls(model=model, **{**values, **extra})

    @property
    def schedule(self) -> dict:
        """The schedule settings: how poros runs the computation, never what it computes."""
        return {k: getattr(self, k) for k in SCHEDULE_NAMES}


def _combination_problems(cfg: TrainConfig, valid: Callable[..., bool]) -> list[str]:
    """The settings that constrain each other, among those `valid` says passed their own check."""
    problems = []
    if valid("kept_layers", "keep_activations") and cfg.kept_layers is not None and not cfg.keep_activations:
        problems.append(f"kept_layers: counts the resident layers that keep their activations, so it needs "
                        f"keep_activations; got kept_layers={cfg.kept_layers} without it")
    if valid("device_inputs", "offload_inputs") and cfg.device_inputs is not None and not cfg.offload_inputs:
        problems.append(f"device_inputs: counts the layers whose saved inputs stay on the device while the others "
                        f"go through host memory, so it needs offload_inputs; got device_inputs={cfg.device_inputs} "
                        "without it")
    if valid("input_stride", "keep_attention") and cfg.input_stride > 1 and cfg.keep_attention:
        problems.append(f"input_stride: a regenerated input has no attention results saved with it, so it needs "
                        f"keep_attention off; got input_stride={cfg.input_stride} with keep_attention")
    if valid("regenerated_layers", "input_stride") and cfg.regenerated_layers is not None and cfg.input_stride == 1:
        problems.append(f"regenerated_layers: bounds the layers whose inputs input_stride regenerates, so it needs "
                        f"input_stride above 1; got regenerated_layers={cfg.regenerated_layers} with input_stride 1")
    if valid("input_stride", "cuda_graphs") and cfg.input_stride > 1 and cfg.cuda_graphs:
        problems.append(f"input_stride: regenerates inputs with eager (or compiled) forwards, not through layer "
                        f"templates; drop cuda_graphs (--no-cuda-graphs), got input_stride={cfg.input_stride}")
    if valid("compile_mlp", "compile") and not cfg.compile_mlp and not cfg.compile:
        problems.append("compile_mlp: off leaves each decoder layer's MLP out of its compiled graph, so it needs "
                        "compile (--compile); got compile_mlp off without it")
    if valid("compile_mlp", "cuda_graphs") and not cfg.compile_mlp and cfg.cuda_graphs:
        problems.append("compile_mlp: off is for layers run without CUDA graphs (layer templates compile each layer "
                        "whole); drop cuda_graphs (--no-cuda-graphs) or compile_mlp off")
    if valid("cuda_graphs", "device") and cfg.cuda_graphs and cfg.device is not Device.CUDA:
        problems.append(f"cuda_graphs: needs device cuda, got {cfg.device.value!r}")
    if valid("shard_stream", "gpus") and cfg.shard_stream and cfg.gpus < 2:
        problems.append(f"shard_stream: shares each streamed copy among data-parallel ranks, so it needs gpus > 1; "
                        f"got gpus={cfg.gpus}")
    if valid("keep_attention", "cuda_graphs") and cfg.keep_attention and cfg.cuda_graphs:
        problems.append("keep_attention: hands attention's recorded results back at each call, which a replayed "
                        "CUDA graph does not make; drop cuda_graphs (--no-cuda-graphs) or keep_attention")
    if valid("cuda_graphs", "lora_dropout") and cfg.cuda_graphs and cfg.lora_dropout > 0:
        problems.append(f"lora_dropout: its masks are drawn per call, which a replayed CUDA graph does not do; "
                        f"drop cuda_graphs (--no-cuda-graphs) or lora_dropout, got lora_dropout={cfg.lora_dropout}")
    if valid("lr_schedule", "decay_steps", "warmup_steps"):
        problems += _schedule_problems(cfg)
    return problems


def _schedule_problems(cfg: TrainConfig) -> list[str]:
    """The learning-rate schedule's settings taken together."""
    schedule, decay, warmup = cfg.lr_schedule, cfg.decay_steps, cfg.warmup_steps
    if schedule is LRSchedule.CONSTANT:
        return [] if decay is None else [f"decay_steps: only linear and cosine decay; got decay_steps={decay} with "
                                         "lr_schedule constant (leave it out, or pick linear or cosine)"]
    if decay is None:
        return [f"decay_steps: lr_schedule {schedule.value} decays to 0 at decay_steps; give it (poros train takes "
                "its --steps)"]
    if warmup >= decay:
        return [f"warmup_steps: expected fewer than decay_steps ({decay}), got {warmup}"]
    return []


# One field per row of the settings table, in its order, typed as its checker declares, with its default.
TrainConfig = make_dataclass(
    "TrainConfig",
    [("model", str)] + [(s.name, s.type, field(default=s.default)) for s in SETTINGS],
    bases=(_Config,),
    namespace={"__doc__": "One training run: a model and every setting of the settings table (poros/settings.py).\n\n"
                          "Raises:\n    ConfigError: listing every invalid field at once."},
    frozen=True,
)
TrainConfig.__module__ = __name__
