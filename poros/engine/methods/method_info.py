"""What each method is, as data: its labels and capabilities, free of torch so that reports, matrix checks and
`--help` can read them. `poros.engine.methods.registry` builds the runnable registry (trainers, capability gates) on
this table; a results row names its method by `Method` value, which `by_value` reads back."""

from __future__ import annotations

from dataclasses import dataclass

from poros.config import Method


@dataclass(frozen=True)
class MethodInfo:
    method: Method
    label: str  # how a report's configuration table names it
    short: str  # how a plot's legend names it beside poros's lines
    gated: bool  # held to bitwise parity with resident QLoRA
    reference: bool = False  # a gate may compare the others with it (resident QLoRA, or its checkpointed form)
    # as a gate's reference, run first and its states recorded in host memory: long context, where it and the
    # method do not fit the device together
    recorded: bool = False
    in_process: bool = True  # a Trainer in this process (False: measured in a child process)
    finetune: bool = False  # `poros train` can train with it
    planned: bool = False  # its cells run a plan (schedule settings, a matrix's `plans:`, host→device copies)
    # its backward runs every layer's forward again from the layer's saved input (gradient checkpointing); a
    # planned method's plan says which layers it recomputes (all but the resident layers that keep activations)
    recomputes: bool = False


INFO: dict[Method, MethodInfo] = {i.method: i for i in (
    MethodInfo(Method.POROS, "poros (blockwise residency)", "poros", gated=True, finetune=True, planned=True),
    MethodInfo(Method.RESIDENT, "resident (full QLoRA)", "resident QLoRA", gated=True, reference=True, finetune=True),
    # bitwise equal to resident (tests/engine/test_resident_gc.py): the reference where resident does not fit
    MethodInfo(Method.RESIDENT_GC, "resident + gradient checkpointing", "resident_gc", gated=True, reference=True,
               recorded=True, recomputes=True),
    # resident_gc, every checkpointed layer's input in host memory (tests/engine/test_resident_gc.py: bitwise
    # resident_gc's): the reference where even resident_gc's saved inputs do not fit the device
    MethodInfo(Method.RESIDENT_GC_OFFLOAD, "resident + gradient checkpointing, inputs in host memory",
               "resident_gc_offload", gated=True, reference=True, recorded=True, recomputes=True),
    MethodInfo(Method.UNSLOTH, "unsloth", "unsloth", gated=False, in_process=False),
)}
NAMES: tuple[str, ...] = tuple(m.value for m in INFO)  # every method as rows and matrices name it, in table order
# the gate's references as rows name them, the one a report prefers as the baseline first (plain resident)
REFERENCES: tuple[str, ...] = tuple(m.value for m, i in INFO.items() if i.reference)
PLANNED: str = next(m.value for m, i in INFO.items() if i.planned)  # the method whose plans a matrix measures
UNGATED: tuple[str, ...] = tuple(m.value for m, i in INFO.items() if not i.gated)  # timed, never gated


def by_value(name: str) -> MethodInfo | None:
    """The method a row or matrix names (`"poros"`, ...); None for a name no method has."""
    try:
        return INFO[Method(name)]
    except ValueError:
        return None


def is_planned(name: str) -> bool:
    """Whether the method named `name` runs plans (poros)."""
    info = by_value(name)
    return info is not None and info.planned


def gate_of(methods) -> tuple[Method, Method] | None:
    """The parity gate a set of methods gets, as (reference, method): the method is the planned one (poros)
    where the set has it, else another gated method; the reference is resident QLoRA where the set has it,
    else resident with gradient checkpointing (a long-context matrix, where plain resident does not fit),
    else resident QLoRA all the same: a gated method is never timed without its gate, and a reference the set
    does not list is run for the gate (its states recorded), not timed. None when the set has no gated method
    but a reference."""
    references = [m for m in INFO if INFO[m].reference and m in methods]  # resident, resident_gc, resident_gc_offload
    reference = references[0] if references else Method.RESIDENT
    others = [m for m in methods if INFO[m].gated and m is not reference]
    if not others:
        return None
    return reference, next((m for m in others if INFO[m].planned), others[0])


def gated(methods) -> bool:
    """Whether a set of methods gets a parity gate cell (`gate_of`)."""
    return gate_of(methods) is not None
