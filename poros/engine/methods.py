"""The methods a matrix compares, as one registry: how each is made, whether it can run here, and
how the parity gate holds it to resident QLoRA."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from poros.config import LoRACompute, Method, TrainConfig
from poros.engine.distributed import SINGLE, World
from poros.engine.executor import PorosTrainer
from poros.engine.trainer import ResidentGCTrainer, ResidentTrainer, Trainer
from poros.engine import unsloth


@dataclass(frozen=True)
class MethodSpec:
    method: Method
    label: str  # how reports name it
    gated: bool  # held to bitwise parity with resident QLoRA
    unavailable: Callable[[str], str | None]  # why it cannot run on a device (None when it can)
    reference: bool = False  # a gate may compare the others with it (resident QLoRA, or its checkpointed form)
    # how its trainer is made, (store, cfg, world) -> Trainer; None: measured in a child process instead
    factory: Callable[..., Trainer] | None = None
    finetune: bool = False  # `poros train` can train with it

    @property
    def in_process(self) -> bool:
        """A Trainer in this process (False: measured in a child process)."""
        return self.factory is not None


def _always(device: str) -> str | None:
    return None


def _unsloth_unavailable(device: str) -> str | None:
    return unsloth.unavailable(device)


METHODS: dict[Method, MethodSpec] = {s.method: s for s in (
    MethodSpec(Method.POROS, "poros (blockwise residency)", gated=True, unavailable=_always, factory=PorosTrainer,
               finetune=True),
    MethodSpec(Method.RESIDENT, "resident (full QLoRA)", gated=True, unavailable=_always, reference=True,
               factory=ResidentTrainer, finetune=True),
    # bitwise equal to resident (tests/engine/test_resident_gc.py): the reference where resident does not fit
    MethodSpec(Method.RESIDENT_GC, "resident + gradient checkpointing", gated=True, unavailable=_always,
               reference=True, factory=ResidentGCTrainer),
    MethodSpec(Method.UNSLOTH, "unsloth", gated=False, unavailable=_unsloth_unavailable),
)}
FINETUNE_METHODS = tuple(m for m, s in METHODS.items() if s.finetune)  # what `poros train --method` takes


def make_trainer(method: Method, store, cfg: TrainConfig, world: World | None = None) -> Trainer:
    """An in-process trainer of `method` on `store`; with a `world` of several ranks, data-parallel
    (poros.engine.distributed).

    Raises:
        ValueError: `method` is measured in a child process (poros.engine.unsloth.measure_unsloth).
    """
    spec = METHODS[method]
    if spec.factory is None:
        raise ValueError(f"{method.value} runs in a child process (poros.engine.unsloth.measure_unsloth)")
    return spec.factory(store, cfg, world or SINGLE)


def config_for(method: Method, cfg: TrainConfig) -> TrainConfig:
    """The settings `method` runs with: a method the gate does not hold to resident's bits (Unsloth) runs
    as its users run it, without strict determinism (which would only slow it or refuse its kernels) and
    without poros's regional `compile` (Unsloth compiles its own kernels and modules, always: its row says
    compile off, as it never runs torch.compile over stock decoder layers). Its LoRA kernels cast the
    adapters to the activations' bf16 whatever the setting: its row says lora_compute bf16."""
    if METHODS[method].gated:
        return cfg
    own = {"deterministic": False, "compile": False, "lora_compute": LoRACompute.BF16}
    return cfg if all(getattr(cfg, k) == v for k, v in own.items()) else cfg.replace(**own)


def method_unavailable(method: Method, device: str) -> str | None:
    """Declared capability gate of `method` on `device` (None when it can run)."""
    return METHODS[method].unavailable(device)


def gate_of(methods) -> tuple[Method, Method] | None:
    """The parity gate a set of methods gets, as (reference, method): the method is poros where the set has
    it, else another gated method; the reference is resident QLoRA where the set has it, else resident with
    gradient checkpointing (a long-context matrix, where plain resident does not fit), else resident QLoRA
    all the same: a gated method is never timed without its gate, and a reference the set does not list is
    run for the gate (its states recorded), not timed. None when the set has no gated method but a reference."""
    references = [m for m in METHODS if METHODS[m].reference and m in methods]
    reference = references[0] if references else Method.RESIDENT
    others = [m for m in methods if METHODS[m].gated and m is not reference]
    if not others:
        return None
    return reference, Method.POROS if Method.POROS in others else others[0]


def gated(methods) -> bool:
    """Whether a set of methods gets a parity gate cell (`gate_of`)."""
    return gate_of(methods) is not None
