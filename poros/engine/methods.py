"""The methods a matrix compares, as one registry: how each is made, whether it can run here, and
how the parity gate holds it to resident QLoRA."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from poros.config import Method, TrainConfig
from poros.engine.distributed import SINGLE
from poros.engine.executor import PorosTrainer
from poros.engine.trainer import ResidentGCTrainer, ResidentTrainer
from poros.engine import unsloth


@dataclass(frozen=True)
class MethodSpec:
    method: Method
    label: str  # how reports name it
    gated: bool  # held to bitwise parity with resident QLoRA
    in_process: bool  # a Trainer in this process (False: measured in a child process)
    unavailable: Callable[[str], str | None]  # why it cannot run on a device (None when it can)
    reference: bool = False  # a gate may compare the others with it (resident QLoRA, or its checkpointed form)


def _always(device: str) -> str | None:
    return None


def _unsloth_unavailable(device: str) -> str | None:
    return unsloth.unavailable(device)


METHODS: dict[Method, MethodSpec] = {s.method: s for s in (
    MethodSpec(Method.POROS, "poros (blockwise residency)", gated=True, in_process=True, unavailable=_always),
    MethodSpec(Method.RESIDENT, "resident (full QLoRA)", gated=True, in_process=True, unavailable=_always,
               reference=True),
    # bitwise equal to resident (tests/engine/test_resident_gc.py): the reference where resident does not fit
    MethodSpec(Method.RESIDENT_GC, "resident + gradient checkpointing", gated=True, in_process=True,
               unavailable=_always, reference=True),
    MethodSpec(Method.UNSLOTH, "unsloth", gated=False, in_process=False, unavailable=_unsloth_unavailable),
)}


def make_trainer(method: Method, store, cfg: TrainConfig, world=None):
    """An in-process trainer of `method` on `store`; with a `world` of several ranks, data-parallel
    (poros.engine.distributed)."""

    world = world or SINGLE
    if method is Method.POROS:

        return PorosTrainer(store, cfg, world=world)
    if method is Method.RESIDENT:

        return ResidentTrainer(store, cfg, world)
    if method is Method.RESIDENT_GC:

        return ResidentGCTrainer(store, cfg, world)
    raise ValueError(f"{method.value} runs in a child process (poros.engine.unsloth.measure_unsloth)")


def config_for(method: Method, cfg: TrainConfig) -> TrainConfig:
    """The settings `method` runs with: a method the gate does not hold to resident's bits (Unsloth) runs
    as its users run it, without strict determinism (which would only slow it or refuse its kernels)."""
    return cfg if METHODS[method].gated or not cfg.deterministic else cfg.replace(deterministic=False)


def method_unavailable(method: Method, device: str) -> str | None:
    """Declared capability gate of `method` on `device` (None when it can run)."""
    return METHODS[method].unavailable(device)


def gate_of(methods) -> tuple[Method, Method] | None:
    """The parity gate a set of methods gets, as (reference, method): the reference is resident QLoRA
    where the set has it, else resident with gradient checkpointing (a long-context matrix, where plain
    resident does not fit); the method is poros where the set has it, else another gated method. None
    when the set has no reference and a gated method besides it."""
    references = [m for m in METHODS if METHODS[m].reference and m in methods]
    if not references:
        return None
    reference = references[0]
    others = [m for m in methods if METHODS[m].gated and m is not reference]
    if not others:
        return None
    return reference, Method.POROS if Method.POROS in others else others[0]


def gated(methods) -> bool:
    """Whether a set of methods gets a parity gate cell (`gate_of`)."""
    return gate_of(methods) is not None
