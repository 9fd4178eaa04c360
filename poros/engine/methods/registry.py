"""The methods a matrix compares, as one registry: how each is made, whether it can run here, and
how the parity gate holds it to resident QLoRA. Their facts (labels, gated, reference, in-process) are the
torch-free table of `poros.engine.methods.method_info`, which reports read; the registry itself loads no torch: each
trainer's module is imported when one is made, so commands that only read it (`poros --help`) stay light."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from poros.config import LoRACompute, Method, TrainConfig
# gate_of, gated: re-exported
from poros.engine.methods.method_info import INFO, MethodInfo, gate_of, gated  # noqa: F401

if TYPE_CHECKING:
    from poros.engine.parallel.distributed import World
    from poros.engine.methods.trainer import Trainer


@dataclass(frozen=True)
class MethodSpec(MethodInfo):
    """A method's facts (`MethodInfo`) with what runs it here."""

    unavailable: Callable[[str], str | None] = lambda device: None  # why it cannot run on `device` (None: it can)
    # how its trainer is made, (store, cfg, world) -> Trainer; None: measured in a child process instead
    factory: Callable[..., Trainer] | None = None

    def __post_init__(self):
        if (self.factory is not None) != self.in_process:
            raise ValueError(f"{self.method.value}: in_process is {self.in_process}, but a trainer factory is "
                             f"{'given' if self.factory else 'missing'}")


def _unsloth_unavailable(device: str) -> str | None:
    """Why Unsloth cannot run here (None when it can). Declared, not discovered by trying."""
    if device != "cuda":
        return "unsloth needs a CUDA GPU (it cannot even be imported without one)"
    if importlib.util.find_spec("unsloth") is None:
        return "unsloth is not installed (pip install 'poros[unsloth]')"
    return None


def _poros(store, cfg: TrainConfig, world: World) -> Trainer:
    from poros.engine.methods.executor import PorosTrainer

    return PorosTrainer(store, cfg, world)


def _resident(store, cfg: TrainConfig, world: World) -> Trainer:
    from poros.engine.methods.trainer import ResidentTrainer

    return ResidentTrainer(store, cfg, world)


def _resident_gc(store, cfg: TrainConfig, world: World) -> Trainer:
    from poros.engine.methods.trainer import ResidentGCTrainer

    return ResidentGCTrainer(store, cfg, world)


def _resident_gc_offload(store, cfg: TrainConfig, world: World) -> Trainer:
    from poros.engine.methods.trainer import ResidentGCOffloadTrainer

    return ResidentGCOffloadTrainer(store, cfg, world)


_RUN = {  # what each method needs beyond its facts (poros.engine.methods.method_info.INFO)
    Method.POROS: dict(factory=_poros),
    Method.RESIDENT: dict(factory=_resident),
    Method.RESIDENT_GC: dict(factory=_resident_gc),
    Method.RESIDENT_GC_OFFLOAD: dict(factory=_resident_gc_offload),
    Method.UNSLOTH: dict(unavailable=_unsloth_unavailable),
}
METHODS: dict[Method, MethodSpec] = {m: MethodSpec(**vars(info), **_RUN[m]) for m, info in INFO.items()}
FINETUNE_METHODS = tuple(m for m, s in METHODS.items() if s.finetune)  # what `poros train --method` takes


def make_trainer(method: Method, store, cfg: TrainConfig, world: World | None = None) -> Trainer:
    """An in-process trainer of `method` on `store`; with a `world` of several ranks, data-parallel
    (poros.engine.parallel.distributed).

    Raises:
        ValueError: `method` is measured in a child process (poros.harness.unsloth).
    """
    from poros.engine.parallel.distributed import SINGLE

    spec = METHODS[method]
    if spec.factory is None:
        raise ValueError(f"{method.value} runs in a child process (poros.harness.unsloth)")
    return spec.factory(store, cfg, world or SINGLE)


def config_for(method: Method, cfg: TrainConfig) -> TrainConfig:
    """The settings `method` runs with: a method the gate does not hold to resident's bits (Unsloth) runs
    as its users run it, without strict determinism (which would only slow it or refuse its kernels) and
    without poros's regional `compile` (Unsloth compiles its own kernels and modules, always: its row says
    compile off, as it never runs torch.compile over stock decoder layers). Its LoRA kernels cast the
    adapters to the activations' bf16 whatever the setting: its row says lora_compute bf16."""
    if METHODS[method].gated:
        return cfg
    own = {"deterministic": False, "compile": False, "compile_mlp": True, "lora_compute": LoRACompute.BF16}
    return cfg if all(getattr(cfg, k) == v for k, v in own.items()) else cfg.replace(**own)


def method_unavailable(method: Method, device: str) -> str | None:
    """Declared capability gate of `method` on `device` (None when it can run)."""
    return METHODS[method].unavailable(device)
