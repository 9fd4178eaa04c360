"""Typed, validated training configuration shared by every method, the gate and the suites."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields


class Method(str, enum.Enum):
    """How the base weights are held while training."""

    POROS = "poros"  # NF4 store in host memory, K layers streamed onto the device at a time
    RESIDENT = "resident"  # ordinary QLoRA: the whole NF4 model on the device
    UNSLOTH = "unsloth"  # Unsloth's FastLanguageModel, as users run it (GPU only)


class Attention(str, enum.Enum):
    """SDPA backend applied to every method alike (`default` lets torch choose)."""

    DEFAULT = "default"
    MATH = "math"
    CUDNN = "cudnn"
    EFFICIENT = "efficient"
    FLASH = "flash"


class Device(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


SHARED_SETTINGS = ("seq_len", "batch_size", "grad_accum", "lora_rank", "lora_alpha", "block_size", "attention",
                   "deterministic", "activation_offload", "overlap_backward", "cuda_graphs")


def _coerce_enum(obj, name: str, enum_cls: type[enum.Enum], problems: list[str]) -> None:
    value = getattr(obj, name)
    if isinstance(value, enum_cls):
        return
    try:
        object.__setattr__(obj, name, enum_cls(value))
    except ValueError:
        allowed = ", ".join(m.value for m in enum_cls)
        problems.append(f"{name}: expected one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class TrainConfig:
    """One training run: model, data shape, LoRA and residency settings.

    Raises:
        ConfigError: listing every invalid field at once.
    """

    model: str
    seq_len: int = 512
    batch_size: int = 1
    grad_accum: int = 1
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lr: float = 1e-4
    block_size: int = 4
    attention: Attention = Attention.DEFAULT
    device: Device = Device.CPU
    seed: int = 0
    data_seed: int = 1234
    pin_memory: bool = True
    deterministic: bool = False  # torch.use_deterministic_algorithms: repeatable attention backward
    # poros: share of layers whose forward keeps its graph, saved tensors offloaded to the host,
    # instead of being recomputed in backward (0 = recompute every layer; see poros/offload.py)
    activation_offload: float = 0.0
    # poros: recompute layer i-1 on the calling thread while layer i's backward runs on a worker
    # thread (the same kernels on the same stream; only the host-side launch work overlaps)
    overlap_backward: bool = True
    # poros, CUDA only: each recomputed layer's recompute + backward replayed from a CUDA graph
    # shared by the layers at the same buffer position (poros/graphs.py)
    cuda_graphs: bool = False
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        from poros.errors import ConfigError

        problems: list[str] = []
        if not isinstance(self.model, str) or not self.model:
            problems.append(f"model: expected a registered name or checkpoint path, got {self.model!r}")
        for name in ("seq_len", "batch_size", "grad_accum", "lora_rank", "lora_alpha", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name}: expected an integer > 0, got {value!r}")
        if not isinstance(self.lr, (int, float)) or self.lr <= 0:
            problems.append(f"lr: expected a number > 0, got {self.lr!r}")
        off = self.activation_offload
        if isinstance(off, bool) or not isinstance(off, (int, float)) or not 0 <= off <= 1:
            problems.append(f"activation_offload: expected a number from 0 to 1, got {off!r}")
        for name in ("pin_memory", "deterministic", "overlap_backward", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}: expected true or false, got {getattr(self, name)!r}")
        targets = tuple(self.lora_targets) if isinstance(self.lora_targets, (list, tuple)) else None
        if not targets or not all(isinstance(t, str) and t for t in targets):
            problems.append(f"lora_targets: expected a non-empty list of module names, got {self.lora_targets!r}")
        else:
            object.__setattr__(self, "lora_targets", targets)
        _coerce_enum(self, "attention", Attention, problems)
        _coerce_enum(self, "device", Device, problems)
        if self.cuda_graphs is True and self.device is not Device.CUDA:
            problems.append(f"cuda_graphs: needs device cuda, got {getattr(self.device, 'value', self.device)!r}")
        if problems:
            raise ConfigError(problems, source="TrainConfig")

    @classmethod
    def from_settings(cls, settings, *, model: str, device: str, **extra) -> "TrainConfig":
        """Build from any object carrying the shared setting names (a Matrix, CLI arguments); `extra`
        adds other fields or overrides shared ones."""
        return cls(model=model, device=device, **{**{k: getattr(settings, k) for k in SHARED_SETTINGS}, **extra})

    def replace(self, **changes) -> "TrainConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return TrainConfig(**values)

    def as_dict(self) -> dict:
        out = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, enum.Enum) else (list(v) if isinstance(v, tuple) else v)
        return out
