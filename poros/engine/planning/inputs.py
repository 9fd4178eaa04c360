"""Where each recomputed layer's saved input lives between its forward and its backward: on the device, or
in host memory (copied out after its forward, brought back a window of backward operations ahead), with what
that costs in device and host memory, and the offload and fetch operations that move them.

Which layers keep theirs on the device: the last K recomputed ones. Every choice of K layers copies the same
bytes (each host-held input out once and back once per micro-batch); the choices differ in the device's peak
and in the time each copy has. The last layers' inputs are written last in the forward and read first in the
backward. Kept on the device, they are consumed before any input has to come back, so the window of returning
inputs takes memory they have freed: the device holds max(K x live, window) + live inputs at once (`live`: the
micro-batches of a layer kept together), not K x live + window + live as it would with the first K layers'
kept there. And the host-held inputs are the first layers': out early in the forward, back late in the
backward, the most time for both copies behind compute; none leaves at the end of the forward only to be
brought back behind the head.

Host memory is one arena of exact size, a slot per host-held layer and live micro-batch, page-locked in place
(poros/engine/saved_inputs.py): torch's caching host allocator would round every pinned block up to a power of
two. A plan's host memory is that arena and the NF4 store (`Plan.host_bytes`); `host_budget` holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from poros.engine.planning.plan import BACKWARD, FETCH, FORWARD, HEAD, OFFLOAD, REGEN, Op
from poros.store.layout import align
from poros.sizes import is_auto


@dataclass(frozen=True)
class HostMemory:
    """This machine's host memory as a run finds it (poros/store/host_memory.py `available_host_memory`), bytes."""

    available: int  # what this process can still allocate
    held: int = 0  # of the plan's host memory, what the process holds already (its built NF4 store)


def host_budget(setting, host: HostMemory | None, cuda: bool) -> int | None:
    """The bytes `host_budget: setting` allows the store and the host-held saved inputs (None: unchecked).
    `auto` is what `host` has free, less the headroom a build keeps (MEMORY_HEADROOM), plus what the process
    holds of it already; unchecked without a measurement (a plan for another machine) or off CUDA (the CPU's
    device memory is the host's: offloading takes nothing more)."""
    from poros.store.host_memory import MEMORY_HEADROOM

    if not is_auto(setting):
        return setting
    if host is None or not cuda:
        return None
    return int(host.available / (1 + MEMORY_HEADROOM)) + host.held


def host_layers(n_layers: int, kept: tuple[int, ...], device_inputs: int | None,
                regenerated: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The layers whose saved inputs go through host memory: every recomputed layer that saves one but the last
    `device_inputs` (None: none goes). Kept layers save no input, nor do those whose input is regenerated."""
    if device_inputs is None:
        return ()
    skip = {*kept, *regenerated}
    recomputed = [i for i in range(n_layers) if i not in skip]
    return tuple(recomputed[: max(0, len(recomputed) - device_inputs)])


def slot_bytes(parts: tuple[int, ...]) -> int:
    """Host bytes of one saved input's slot: its tensors back to back, each aligned."""
    return sum(align(p) for p in parts)


def saved_bytes(n_layers: int, on_device: int, on_host: int, live: int, window: int, one: int) -> int:
    """Device bytes of saved inputs at their peak: every layer's (`live` micro-batches each) where none goes to
    host memory; else the `on_device` layers' inputs, which the backward consumes first, or the window of inputs
    coming back, whichever is more, and the `live` inputs of the layer in backward (module docstring)."""
    if not on_host:
        return n_layers * live * one
    return (max(on_device * live, window) + live) * one


def least_on_device(recomputed: int, live: int, slot: int, store: int, budget: int | None) -> int | None:
    """The fewest recomputed layers whose saved inputs must stay on the device for the store and the rest to
    fit `budget` in host memory (0 when all fit, None when not even the store does)."""
    if budget is None:
        return 0
    if store > budget:
        return None
    on_host = (budget - store) // (live * slot) if slot else recomputed
    return max(0, recomputed - on_host)


def input_ops(step: list[Op], host: tuple[int, ...], live: int, window: int, regenerated: tuple[int, ...] = ()) -> list[Op]:
    """`step` with the moves of the host-held saved inputs: each offloaded right after the forward that saves
    it, into slot (its layer's place among `host`) x live + micro-batch mod live; each fetched ahead of its
    first reader (its backward, or a regeneration from it, input_stride): the first reader's behind the head,
    and at each reader the inputs of the `window` readers after it, those already offloaded (micro-major, the
    next micro-batch's come from its own head)."""
    if not host:
        return list(step)
    where = {layer: k for k, layer in enumerate(host)}
    regen = set(regenerated)

    def reads(op: Op) -> bool:
        return op.kind == BACKWARD or op.kind == REGEN and op.layer not in regen

    readers = [(op.layer, op.micro) for op in step if reads(op)]
    offloaded, fetched = set(), set()
    out: list[Op] = []
    # readers[:seen] have been looked at once; of those, `waiting` (in order) were not offloaded yet when looked
    # at, and a later look at the same range may fetch them: each reader is looked at once, not `window` times
    seen, waiting = 0, []

    def fetch(lo: int, hi: int) -> None:
        """Fetch, in order, the inputs of readers[lo:hi] that are offloaded and not fetched yet."""
        nonlocal seen, waiting
        looked = [i for i in waiting if i >= lo] + list(range(max(seen, lo), max(seen, min(hi, len(readers)))))
        seen = max(seen, min(hi, len(readers)))
        waiting = []
        for i in looked:
            if i >= hi:
                waiting.append(i)
                continue
            layer, micro = key = readers[i]
            if key in fetched:
                continue
            if key not in offloaded:
                waiting.append(i)
                continue
            fetched.add(key)
            out.append(Op(FETCH, layer=layer, micro=micro, buffer=where[layer] * live + micro % live))

    done = 0
    for op in step:
        if op.kind == HEAD:
            fetch(done, done + 1)
        elif reads(op):
            done += 1
            fetch(done - 1, done + window)
        out.append(op)
        if op.kind == FORWARD and op.layer in where:
            offloaded.add((op.layer, op.micro))
            out.append(Op(OFFLOAD, layer=op.layer, micro=op.micro, buffer=where[op.layer] * live + op.micro % live))
    return out


def host_refusal(plan, what: str) -> str | None:
    """The one-line refusal of a plan (`what` names it) that keeps saved inputs in host memory beyond its host
    budget; None when it fits, or keeps none there (the store alone is the build's to check:
    poros/store/host_memory.py)."""
    from poros.engine.planning.memory import gb
    from poros.sizes import format_size

    if plan.host_budget is None or not plan.host_inputs or plan.host_bytes <= plan.host_budget:
        return None
    return (f"{what} keeps the saved inputs of {len(plan.host_inputs)} layers in host memory ({gb(plan.host_input_bytes)}) "
            f"beside the NF4 store ({gb(plan.store_bytes)}): {gb(plan.host_bytes)}, more than host_budget "
            f"{format_size(plan.host_budget)} allows; keep more of them on the device (--offload-inputs --device-inputs "
            "N, or a larger --vram-budget), use a shorter --seq-len, or give a --host-budget this machine has")
