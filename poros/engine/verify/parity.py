"""The bitwise parity gate: a reference (resident QLoRA, or resident with gradient checkpointing where
resident does not fit) and a method (poros) from one initial state, compared with torch.equal."""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from poros.config import Method, TrainConfig
from poros.engine.parallel.distributed import SINGLE, agree, share_store
from poros.engine.runtime.allocator_limit import AllocatorLimit
from poros.engine.methods.registry import make_trainer
from poros.engine.verify.parity_digest import Digest
from poros.engine.verify.step_state import StepState
from poros.engine.methods.trainer import Trainer, deterministic_kernels
from poros.store.arena import slot_tensors


@dataclass
class ParityResult:
    parity: str  # "PASS" or "FAIL"
    steps: int
    tensors_compared: int
    first_mismatch: str | None
    max_abs_diff: float
    device: str
    attention: str
    model: str = ""
    block_size: int = 0
    seq_len: int = 0
    grad_accum: int = 1
    accumulation: str = "layer"
    resident_layers: int = 0  # layers the plan kept on the device for the whole step
    gate: str = "resident"  # the reference `method` was compared with: resident, resident_gc, or "control"
    # (the reference against a second run of itself); "(recorded)" when its states were recorded first
    method: str = "poros"  # the method compared with the reference
    # ranks, each gating its own states (poros.engine.parallel.distributed); PASS only if every rank's is
    world_size: int = 1
    ranks: list = field(default_factory=list)  # each rank's verdict when world_size > 1
    losses: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.parity == "PASS"

    def json(self) -> str:
        return json.dumps(asdict(self))


class Comparator:
    """Counts compared tensors; remembers the first that differs and the largest difference."""

    def __init__(self):
        self.count = 0
        self.first: str | None = None
        self.max_abs = 0.0

    def equal(self, name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        self.count += 1
        # a reference kept as digests (poros/engine/verify/parity_digest.py): equal bytes or not
        if isinstance(a, Digest):
            same = a.matches(b)
            diff = 0.0 if same else float("inf")
        elif a is None or b is None:
            same = a is None and b is None
            diff = 0.0 if same else float("inf")
        else:
            a, b = a.detach(), b.detach().to(a.device)
            same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
            if same:
                diff = 0.0
            elif a.shape != b.shape:
                diff = float("inf")
            else:
                diff = float((a.double() - b.double()).abs().max()) if a.is_floating_point() else float(
                    (a.int() - b.int()).abs().max()
                )
                diff = diff if diff == diff else float("inf")  # NaN counts as a mismatch of unknown size
                diff = diff if diff > 0 else float("inf")  # e.g. -0.0 vs 0.0 or differing NaN payloads
        if not same:
            self.max_abs = max(self.max_abs, diff)
            if self.first is None:
                self.first = name
        return same

    def all_equal(self, prefix: str, a: dict, b: dict) -> bool:
        ok = True
        for name in list(a) + [n for n in b if n not in a]:
            ok &= self.equal(f"{prefix}{name}", a.get(name), b.get(name))
        return ok


def compare_base_weights(cmp: Comparator, resident: Trainer, poros: Trainer) -> bool:
    """The resident device copies of every NF4 matrix against the bytes poros streams from."""
    ok = True
    arena = poros.store.arena
    for slot in poros.store.slots():
        w = resident.qlora.linear4bit[slot.name].weight
        t, state = slot_tensors(arena, slot), w.quant_state
        ok &= cmp.equal(f"{slot.name}.weight", w.data, t.weight)
        ok &= cmp.equal(f"{slot.name}.weight.absmax", state.absmax, t.absmax)
        if slot.double_quant:
            ok &= cmp.equal(f"{slot.name}.weight.nested_absmax", state.state2.absmax, t.nested_absmax)
            ok &= cmp.equal(f"{slot.name}.weight.offset", state.offset, t.offset)
    return ok


def take_step(trainer: Trainer, step: int, to_host: bool = False) -> StepState:
    """One optimizer step of `trainer` on synthetic step `step`: its losses, the LoRA gradients before the
    optimizer step, the LoRA weights and AdamW state after it (copied to host memory with `to_host`)."""
    keep = (lambda d: {k: None if v is None else v.detach().to("cpu", copy=True) for k, v in d.items()}) \
        if to_host else (lambda d: d)
    with deterministic_kernels():
        losses = trainer.accumulate_step(trainer.batches(step))
    grads = keep(trainer.lora_grads())
    trainer.optimizer_step()
    return StepState([x.detach().to("cpu") if to_host else x for x in losses], grads, keep(trainer.lora_state()),
                     keep(trainer.optimizer_state()))


STATES_PER_STEP = 4  # what a recorded step holds, in copies of the LoRA weights (gradients, weights, AdamW's moments)


class RecordedReference:
    """A reference's states (resident QLoRA's, or resident_gc's) for `steps` steps, recorded in host memory:
    a gate for a trainer that cannot share the device with the reference (both would not fit), at the cost
    of host memory for the states."""

    def __init__(self, trainer: Trainer, steps: int):
        self.cfg, self.method = trainer.cfg, trainer.method
        self.init = {k: v.detach().to("cpu", copy=True) for k, v in trainer.lora_state().items()}
        # each step records the LoRA gradients, the weights and AdamW's two moments: four copies of the weights
        weights = sum(v.numel() * v.element_size() for v in self.init.values())
        trainer.leave_host_memory(STATES_PER_STEP * steps * weights)
        self.states = [take_step(trainer, s, to_host=True) for s in range(steps)]


def _result(poros: Trainer, gate: str) -> ParityResult:
    cfg = poros.cfg
    plan = poros.plan
    return ParityResult("PASS", 0, 0, None, 0.0, cfg.device.value, cfg.attention.value, model=cfg.model,
                        block_size=plan.block_size if plan else cfg.block_size, seq_len=cfg.seq_len,
                        grad_accum=cfg.grad_accum, accumulation=cfg.accumulation.value,
                        resident_layers=len(plan.resident_layers) if plan else 0, gate=gate, method=poros.method,
                        world_size=poros.world.size)


def _compare(cmp: Comparator, result: ParityResult, reference: Callable[[int], StepState], poros: Trainer,
             steps: int, ok: bool, on_step=None) -> ParityResult:
    step = 0
    while ok and step < steps:
        ref = reference(step)
        mine = take_step(poros, step)
        for m, (a, b) in enumerate(zip(ref.losses, mine.losses, strict=True)):
            ok &= cmp.equal(f"step{step}.micro{m}.loss", a, b)
            result.losses.append(float(a))
        ok &= cmp.all_equal(f"step{step}.grad:", ref.grads, mine.grads)
        ok &= cmp.all_equal(f"step{step}.weight:", ref.weights, mine.weights)
        ok &= cmp.all_equal(f"step{step}.adamw:", ref.adamw, mine.adamw)
        step += 1
        result.steps = step
        if on_step:
            on_step(step, result)
    result.tensors_compared = cmp.count
    result.first_mismatch = cmp.first
    result.max_abs_diff = cmp.max_abs
    result.parity = "PASS" if ok and cmp.first is None else "FAIL"
    return result


def run_gate(
    resident: Trainer,
    poros: Trainer,
    steps: int,
    *,
    verify_initial: bool = True,
    on_step: Callable[[int, ParityResult], None] | None = None,
) -> ParityResult:
    """Train both for `steps` optimizer steps on the same data, comparing after every step.

    `resident` is the reference (resident QLoRA or resident_gc), `poros` the method held to it (poros,
    resident_gc, or the reference's own method: a control). Compared: the initial LoRA weights (and,
    for poros, the NF4 bytes it streams from); then per step the loss of every micro-batch, every LoRA
    gradient before the optimizer step, every LoRA weight and AdamW state tensor after it. Stops after
    the first step with a mismatch.
    """
    cmp = Comparator()
    result = _result(poros, "control" if poros.method == resident.method else resident.method)
    ok = True
    if verify_initial:
        if poros.plan is not None:  # it streams the store's bytes: they must be the reference's
            ok &= compare_base_weights(cmp, resident, poros)
        ok &= cmp.all_equal("init:", resident.lora_state(), poros.lora_state())
    return _compare(cmp, result, lambda s: take_step(resident, s), poros, steps, ok, on_step)


def run_gate_recorded(reference, poros: Trainer, steps: int | None = None) -> ParityResult:
    """The gate against resident states recorded earlier, step by step: a `RecordedReference`, or its digests
    (`poros.engine.verify.parity_digest.DigestReference`, kept by an earlier part of a run)."""
    steps = len(reference.states) if steps is None else min(steps, len(reference.states))
    cmp = Comparator()
    result = _result(poros, f"{reference.method} (recorded)")
    ok = cmp.all_equal("init:", reference.init, poros.lora_state())
    return _compare(cmp, result, lambda s: reference.states[s], poros, steps, ok)


def holds_a_cap(cfg: TrainConfig, method: Method) -> bool:
    """Whether `method` on `cfg` holds torch's allocator to its budget (poros/engine/runtime/allocator_limit.py
    `AllocatorLimit`)."""
    return method is Method.POROS and AllocatorLimit.holds(cfg)


def record_reference(reference: Method, store, cfg: TrainConfig, steps: int, world=SINGLE) -> RecordedReference:
    """`reference` set up on `store`, its states over `steps` steps recorded in host memory, and the trainer
    released (its device memory returned to the driver) before the gated side is set up: the first half of a
    sequential gate."""
    ref = make_trainer(reference, store, cfg, world)
    try:
        return RecordedReference(ref, steps)
    finally:
        ref.close()
        del ref
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def parity(
    cfg: TrainConfig,
    steps: int = 3,
    *,
    store=None,
    mutate: Callable[[Trainer, Trainer], None] | None = None,
    verify_initial: bool = True,
    progress: bool | None = None,
    control: bool = False,
    method: Method = Method.POROS,
    reference: Method = Method.RESIDENT,
    sequential: bool = False,
    world=None,
) -> ParityResult:
    """Build the model once, set up `reference` and `method` from it, and run the gate.

    `mutate(reference, method)` runs after setup (negative controls use it to corrupt one side).
    `control=True` compares the reference with a second run of itself: a FAIL there means the
    kernels themselves (e.g. an attention backward) are not run-to-run repeatable here.
    `sequential=True` runs the reference first, records its states in host memory and releases it
    before the method is set up (`RecordedReference`): the gate for settings where the two do not fit
    the device together (long context), and always for a method that holds the allocator to a budget
    (`holds_a_cap`): the cap is process-wide, so a reference alive beside it would count against it.
    With a `world` of several ranks (poros.engine.parallel.distributed) both sides are data-parallel (the reference
    under DistributedDataParallel), every rank gates its own states, and the result is PASS only if every
    rank's is.
    """

    world = world or SINGLE
    if store is None:
        store, _ = share_store(cfg.model, seed=cfg.seed, device=cfg.device.value, world=world, progress=progress,
                               double_quant=cfg.double_quant)
    method = reference if control else method
    if mutate is None and holds_a_cap(cfg, method):
        sequential = True
    if sequential:
        if mutate is not None:
            raise ValueError("mutate needs both trainers at once: not with sequential=True")
        recorded = record_reference(reference, store, cfg, steps, world)
        result = run_gate_recorded(recorded, make_trainer(method, store, cfg, world), steps)
        if control:
            result.gate = "control (recorded)"
        return agree(result, world)
    ref, mine = make_trainer(reference, store, cfg, world), make_trainer(method, store, cfg, world)
    if mutate is not None:
        mutate(ref, mine)
    return agree(run_gate(ref, mine, steps, verify_initial=verify_initial), world)
