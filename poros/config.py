"""`TrainConfig`: one run's model and settings, a frozen dataclass generated from the settings table
(poros/settings.py): one field per setting, typed as its checker declares, validated once."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import field, make_dataclass
from poros.choices import (  # noqa: F401  (re-exported: the config's vocabulary)
    Accumulation,
    Attention,
    Device,
    LoRACompute,
    LRSchedule,
    Placement,
)
from poros import resolve
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
    """How the base weights are held while training (see poros/engine/methods/registry.py)."""

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
        problems += resolve.problems(self, lambda *names: all(n in values for n in names))
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
    def backward_overlaps(self) -> bool:
        """Whether a layer's recompute runs while the backward before it is in flight (a worker thread): as
        `overlap_backward` says, except under CUDA-graph layer templates, which replay one layer's backward at a
        time."""
        return self.overlap_backward and not self.cuda_graphs

    @property
    def schedule(self) -> dict:
        """The schedule settings: how poros runs the computation, never what it computes."""
        return {k: getattr(self, k) for k in SCHEDULE_NAMES}


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
