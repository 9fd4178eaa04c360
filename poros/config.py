"""`TrainConfig`: one run's model and settings, typed and validated from the settings table."""

from __future__ import annotations

import enum
from dataclasses import field, fields, make_dataclass

from poros.errors import ConfigError
from poros.settings import (  # noqa: F401  (re-exported: the config's vocabulary)
    BY_NAME,
    COMPUTED_NAMES,
    LORA_TARGETS,
    SCHEDULE_NAMES,
    SETTINGS,
    Accumulation,
    Attention,
    Device,
    LoRACompute,
    LRSchedule,
    Placement,
    check_values,
)


class Method(str, enum.Enum):
    """How the base weights are held while training (see poros/engine/methods.py)."""

    POROS = "poros"  # NF4 store in host memory, streamed onto the device by a plan
    RESIDENT = "resident"  # ordinary QLoRA: the whole NF4 model on the device
    RESIDENT_GC = "resident_gc"  # resident QLoRA with gradient checkpointing per decoder layer (long context)
    UNSLOTH = "unsloth"  # Unsloth's FastLanguageModel, as users run it (GPU only)


def _post_init(self) -> None:
    problems: list[str] = []
    if not isinstance(self.model, str) or not self.model:
        problems.append(f"model: expected a registered name or checkpoint path, got {self.model!r}")
    values, bad = check_values({s.name: getattr(self, s.name) for s in SETTINGS})
    problems += bad
    for k, v in values.items():
        object.__setattr__(self, k, v)
    if self.kept_layers is not None and self.keep_activations is not True:
        problems.append(f"kept_layers: counts the resident layers that keep their activations, so it needs "
                        f"keep_activations; got kept_layers={self.kept_layers} without it")
    if self.cuda_graphs is True and getattr(self.device, "value", self.device) != "cuda":
        problems.append(f"cuda_graphs: needs device cuda, got {getattr(self.device, 'value', self.device)!r}")
    if self.shard_stream is True and isinstance(self.gpus, int) and self.gpus < 2:
        problems.append(f"shard_stream: shares each streamed copy among data-parallel ranks, so it needs gpus > 1; "
                        f"got gpus={self.gpus}")
    if self.keep_attention is True and self.cuda_graphs is True:
        problems.append("keep_attention: hands attention's recorded results back at each call, which a replayed "
                        "CUDA graph does not make; drop cuda_graphs (--no-cuda-graphs) or keep_attention")
    if self.cuda_graphs is True and isinstance(self.lora_dropout, float) and self.lora_dropout > 0:
        problems.append(f"lora_dropout: its masks are drawn per call, which a replayed CUDA graph does not do; "
                        f"drop cuda_graphs (--no-cuda-graphs) or lora_dropout, got lora_dropout={self.lora_dropout}")
    problems += _schedule_problems(self)
    if problems:
        raise ConfigError(problems, source="TrainConfig")


def _schedule_problems(cfg) -> list[str]:
    """The learning-rate schedule's settings taken together (each one already checked alone)."""
    schedule, decay, warmup = cfg.lr_schedule, cfg.decay_steps, cfg.warmup_steps
    if not isinstance(schedule, LRSchedule) or not isinstance(warmup, int) or not (decay is None or
                                                                                   isinstance(decay, int)):
        return []  # named already
    if schedule is LRSchedule.CONSTANT:
        return [] if decay is None else [f"decay_steps: only linear and cosine decay; got decay_steps={decay} with "
                                         "lr_schedule constant (leave it out, or pick linear or cosine)"]
    if decay is None:
        return [f"decay_steps: lr_schedule {schedule.value} decays to 0 at decay_steps; give it (poros train takes "
                "its --steps)"]
    if warmup >= decay:
        return [f"warmup_steps: expected fewer than decay_steps ({decay}), got {warmup}"]
    return []


def _replace(self, **changes) -> "TrainConfig":
    values = {f.name: getattr(self, f.name) for f in fields(self)}
    values.update(changes)
    return TrainConfig(**values)


def _as_dict(self) -> dict:
    """Every setting (enums as their values), as results rows record them."""
    out = {"model": self.model}
    for s in SETTINGS:
        v = getattr(self, s.name)
        out[s.name] = v.value if isinstance(v, enum.Enum) else (list(v) if isinstance(v, tuple) else v)
    return out


def _from_settings(cls, settings: dict, *, model: str, **extra) -> "TrainConfig":
    """From a mapping of setting names (a matrix's, parsed flags); `extra` adds or overrides."""
    values = {k: v for k, v in settings.items() if k in BY_NAME}
    return cls(model=model, **{**values, **extra})


def _schedule(self) -> dict:
    """The schedule settings: how poros runs the computation, never what it computes."""
    return {k: getattr(self, k) for k in SCHEDULE_NAMES}


# The fields are the settings table's rows, in its order, with its defaults (mutable defaults by factory).
TrainConfig = make_dataclass(
    "TrainConfig",
    [("model", str)] + [(s.name, object, field(default=s.default)) for s in SETTINGS]
    + [("extra", dict, field(default_factory=dict, compare=False, repr=False))],
    namespace={"__post_init__": _post_init, "replace": _replace, "as_dict": _as_dict,
               "from_settings": classmethod(_from_settings), "schedule": property(_schedule),
               "__doc__": "One training run: a model and every setting of the settings table (poros/settings.py).\n\n"
                          "Raises:\n    ConfigError: listing every invalid field at once."},
    frozen=True,
)
TrainConfig.__module__ = __name__
