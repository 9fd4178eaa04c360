"""The rules every plan keeps, properties of the plan alone (so tested without a GPU); `check` lists the
ones a plan breaks:

  - weights present: a layer runs only while its group is in its buffer;
  - no early refill: a load into a buffer comes after a release that follows every read of the
    buffer's previous contents (bitsandbytes keeps the packed weight on its autograd context, so a
    refill before the backward that reads it corrupts gradients silently);
  - order: per micro-batch, forwards ascend, the head follows the last forward, backwards descend
    after the head; per layer, micro-batch backwards run in micro-batch order, so every LoRA
    gradient is the same floating-point sum as resident QLoRA's;
  - steady state: a step leaves the buffers as it found them, so every step is the same plan;
  - gathered (shard_stream, `shards` ranks): each rank loads its 1/shards of a streamed copy and a gather
    completes it from the other ranks; no compute reads a buffer between its load and its gather, and a
    gather, which writes the buffer as a load does, never comes before the release after the last read;
  - saved inputs in host memory: exactly the inputs of the layers the plan places there (`host_inputs`, never
    a kept layer's) are offloaded, each after the forward that saves it and into its own slot, and fetched once,
    after it was offloaded and before its backward; no offload overwrites a slot whose input has not been
    fetched yet (the backward would read another input);
  - regenerated inputs (input_stride): a layer in `regenerated` saves no input in forward; its input is made in
    backward by one regeneration (the forward of the layer below, its weights present, from that layer's input on
    the device: saved there, fetched back, or regenerated itself), before its backward; a regeneration makes only
    the input of a layer in `regenerated`, once per micro-batch, after that layer's forward.
"""

from __future__ import annotations

from collections import Counter

from poros.engine.planning.plan import (
    BACKWARD,
    FETCH,
    FORWARD,
    GATHER,
    GATHER_HEAD,
    HEAD,
    HEAD_SLOT,
    LOAD,
    LOAD_HEAD,
    OFFLOAD,
    REGEN,
    RELEASE,
    RELEASE_HEAD,
    Op,
    Plan,
)


class _At:
    """Where in a plan a problem is (`op 12 (forward:g1:L3:m0)`), formatted only where a message uses it: the
    planner's search checks thousands of plans of thousands of operations, nearly all of them without a problem."""

    __slots__ = ("pos", "op", "part")

    def __init__(self, pos: int, op: Op, part: str = "op"):
        self.pos, self.op, self.part = pos, op, part

    def __str__(self) -> str:
        return f"{self.part} {self.pos} ({self.op})"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def check(plan: Plan) -> list[str]:
    """Every rule the plan breaks (empty when it is safe to run); see the module docstring."""
    problems: list[str] = []
    holds: dict[int, int] = {}  # buffer -> group (or HEAD_SLOT)
    released: dict[int, bool] = {}  # buffer -> released since its last read
    ungathered: set[int] = set()  # buffers holding this rank's share of a load, the others' not gathered yet

    def shared(op: Op) -> bool:
        return plan.shards > 1 and (op.kind == LOAD_HEAD or not plan.groups[op.group].resident)

    def gather(where: _At, op: Op) -> None:
        b, want = op.buffer, (op.group if op.kind == GATHER else HEAD_SLOT)
        if plan.shards == 1:
            problems.append(f"{where}: a gather in a plan whose copies are not shared among ranks")
        if holds.get(b) != want:
            problems.append(f"{where}: gathers {'the lm_head' if want == HEAD_SLOT else f'group {want}'} into "
                            f"buffer {b}, which holds {holds.get(b)}")
        if b in ungathered:  # right behind its load, which came after the release
            ungathered.discard(b)
        elif not released.get(b, True):
            problems.append(f"{where}: gathers into buffer {b} before the release after the last read of its "
                            f"contents: a pending backward would read the other ranks' new bytes")
        else:
            problems.append(f"{where}: gathers buffer {b} with no share of a load awaiting it")

    for pos, op in enumerate(plan.setup):
        if op.kind in (GATHER, GATHER_HEAD):
            gather(_At(pos, op, "setup op"), op)
            continue
        holds[op.buffer] = op.group
        released[op.buffer] = True
        (ungathered.add if shared(op) else ungathered.discard)(op.buffer)
    seen_fwd, seen_bwd, seen_head = set(), set(), set()
    last_bwd: dict[int, int] = {}
    group_of = plan.group_of

    for pos, op in enumerate(plan.step):
        where = _At(pos, op)
        if op.kind in (LOAD, LOAD_HEAD):
            b = op.buffer
            if op.kind == LOAD and plan.groups[op.group].buffer != b:
                problems.append(f"{where}: group {op.group} belongs in buffer {plan.groups[op.group].buffer}")
            if b in holds and not released.get(b, True):
                problems.append(f"{where}: loads buffer {b} before the release after the last read of its "
                                f"contents (group {holds[b]}): a pending backward would read the new bytes")
            if op.kind == LOAD and any(bb.index == b and bb.resident for bb in plan.buffers) and b in holds:
                problems.append(f"{where}: reloads resident buffer {b}")
            holds[b] = op.group if op.kind == LOAD else HEAD_SLOT
            released[b] = False if op.kind == LOAD_HEAD else True
            (ungathered.add if shared(op) else ungathered.discard)(b)
        elif op.kind in (GATHER, GATHER_HEAD):
            gather(where, op)
        elif op.kind in (RELEASE, RELEASE_HEAD):
            released[op.buffer] = True
        elif op.kind in (FORWARD, BACKWARD, REGEN):
            g = group_of.get(op.layer)
            if g is None:
                problems.append(f"{where}: no group holds layer {op.layer}")
                continue
            if holds.get(g.buffer) != g.index:
                problems.append(f"{where}: layer {op.layer}'s weights are not present (buffer {g.buffer} holds "
                                f"{holds.get(g.buffer)}, not group {g.index})")
            elif g.buffer in ungathered:
                problems.append(f"{where}: reads buffer {g.buffer} before its gather: only this rank's share of "
                                f"group {g.index} is there")
            released[g.buffer] = False
            key = (op.layer, op.micro)
            if op.kind == REGEN:  # its inputs' rules: `_input_problems`
                continue
            if op.kind == FORWARD:
                if key in seen_fwd:
                    problems.append(f"{where}: layer {op.layer} forwarded twice for micro-batch {op.micro}")
                if op.layer > 0 and (op.layer - 1, op.micro) not in seen_fwd:
                    problems.append(f"{where}: forward before layer {op.layer - 1}'s for micro-batch {op.micro}")
                seen_fwd.add(key)
            else:
                if key not in seen_fwd:
                    problems.append(f"{where}: backward before the forward of layer {op.layer}, micro-batch {op.micro}")
                if op.micro not in seen_head:
                    problems.append(f"{where}: backward before the head of micro-batch {op.micro}")
                if op.layer + 1 < plan.n_layers and (op.layer + 1, op.micro) not in seen_bwd:
                    problems.append(f"{where}: backward before layer {op.layer + 1}'s for micro-batch {op.micro}")
                if key in seen_bwd:
                    problems.append(f"{where}: layer {op.layer} backpropagated twice for micro-batch {op.micro}")
                if last_bwd.get(op.layer, -1) > op.micro:
                    problems.append(f"{where}: micro-batch {op.micro} after {last_bwd[op.layer]} at layer {op.layer}: "
                                    "LoRA gradients would be summed in another order than resident QLoRA's")
                last_bwd[op.layer] = max(last_bwd.get(op.layer, -1), op.micro)
                seen_bwd.add(key)
        elif op.kind == HEAD:
            if (plan.n_layers - 1, op.micro) not in seen_fwd:
                problems.append(f"{where}: head before the last layer's forward of micro-batch {op.micro}")
            if not plan.head_resident and holds.get(plan.head_buffer if plan.head_buffer is not None else -1) != HEAD_SLOT:
                problems.append(f"{where}: the lm_head weight is not present")
            elif plan.head_buffer in ungathered:
                problems.append(f"{where}: reads the lm_head before its gather: only this rank's share is there")
            if plan.head_buffer is not None:
                released[plan.head_buffer] = False
            seen_head.add(op.micro)
        elif op.kind not in (OFFLOAD, FETCH):  # saved inputs' moves: `_input_problems`
            problems.append(f"{where}: unknown operation")
    resident = set(plan.resident_layers)
    for i in plan.kept_layers:
        if i not in resident:
            problems.append(f"layer {i} keeps its activations but is streamed: its buffer is refilled before its "
                            "backward reads the packed weight its autograd context holds")
    want = {(i, m) for i in range(plan.n_layers) for m in range(plan.grad_accum)}
    if seen_fwd != want or seen_bwd != want:
        missing = sorted(want - seen_fwd) + sorted(want - seen_bwd)
        problems.append(f"step: not every (layer, micro-batch) has one forward and one backward; missing {missing[:4]}")
    if seen_head != set(range(plan.grad_accum)):
        problems.append("step: not every micro-batch has its head")
    if ungathered:
        problems.append(f"step: ends with buffer(s) {sorted(ungathered)} holding a share whose gather never came")
    return problems + _input_problems(plan)


def _input_problems(plan: Plan) -> list[str]:
    """The saved-input rules (module docstring): each input's state along the step, and each slot's contents."""
    problems: list[str] = []
    host, kept = set(plan.host_inputs), set(plan.kept_layers)
    regen = set(plan.regenerated)
    for i in sorted(host & kept):
        problems.append(f"layer {i} keeps its activations: it saves no input for host memory to hold")
    for i in sorted(regen & (host | kept)):
        problems.append(f"layer {i}'s input is regenerated, but the plan also "
                        + ("keeps its activations" if i in kept else "places it in host memory"))
    state: dict = {}  # (layer, micro) -> "device" (saved there), "host" (in a slot), "back" (fetched), "done"
    slots: dict[int, tuple] = {}  # slot -> the input in it, not fetched yet
    for pos, op in enumerate(plan.step):
        where, key = _At(pos, op), (op.layer, op.micro)
        if op.kind == FORWARD and op.layer not in kept:
            state[key] = "unsaved" if op.layer in regen else "device"
        elif op.kind == REGEN:
            made = (op.layer + 1, op.micro)
            if state.get(key) not in ("device", "back", "regenerated"):
                problems.append(f"{where}: regenerates from the input of layer {op.layer}, micro-batch {op.micro}, "
                                f"which is not on the device ({state.get(key, 'not saved')})")
            if op.layer + 1 not in regen:
                problems.append(f"{where}: makes the input of layer {op.layer + 1}, which the plan does not regenerate")
            elif state.get(made) != "unsaved":
                problems.append(f"{where}: makes the input of layer {made[0]}, micro-batch {op.micro}, "
                                + ("before its forward" if made not in state else f"which is {state[made]} already"))
            else:
                state[made] = "regenerated"
        elif op.kind == OFFLOAD:
            if op.layer not in host:
                problems.append(f"{where}: moves layer {op.layer}'s saved input, which the plan keeps on the device")
            if state.get(key) != "device":
                problems.append(f"{where}: offloads the input of layer {op.layer}, micro-batch {op.micro}, "
                                f"{'which is not on the device' if key in state else 'before its forward saved it'}")
            if not 0 <= op.buffer < plan.host_slots:
                problems.append(f"{where}: slot {op.buffer} is not one of the host arena's {plan.host_slots}")
            elif op.buffer in slots:
                problems.append(f"{where}: overwrites slot {op.buffer}, which holds the input of layer "
                                f"{slots[op.buffer][0]}, micro-batch {slots[op.buffer][1]}, before it is fetched: "
                                "that backward would read another input")
            slots[op.buffer] = key
            state[key] = "host"
        elif op.kind == FETCH:
            if state.get(key) != "host":
                problems.append(f"{where}: fetches the input of layer {op.layer}, micro-batch {op.micro} "
                                + ("before it was offloaded" if state.get(key) in (None, "device") else
                                   "when it is not in host memory"))
            elif slots.get(op.buffer) != key:
                problems.append(f"{where}: fetches slot {op.buffer}, which holds "
                                f"{slots.get(op.buffer, 'nothing')}, not the input of layer {op.layer}, "
                                f"micro-batch {op.micro}")
            slots.pop(op.buffer, None)
            state[key] = "back"
        elif op.kind == BACKWARD and op.layer not in kept:
            if op.layer in regen and state.get(key) != "regenerated":
                problems.append(f"{where}: backward of layer {op.layer}, micro-batch {op.micro} before its input is "
                                "regenerated")
            if state.get(key) == "host":
                problems.append(f"{where}: backward of layer {op.layer}, micro-batch {op.micro} before its saved "
                                "input is fetched from host memory")
            state[key] = "done"
    moved = {(op.layer, op.micro) for op in plan.step if op.kind == OFFLOAD}
    for i in sorted(host - kept):
        for m in range(plan.grad_accum):
            if (i, m) not in moved:
                problems.append(f"layer {i}'s saved input (micro-batch {m}) is placed in host memory but never "
                                "offloaded: the device would hold it and the plan's memory would not count it")
    offloads = [(op.layer, op.micro) for op in plan.step if op.kind == OFFLOAD]
    fetches = [(op.layer, op.micro) for op in plan.step if op.kind == FETCH]
    for what, keys in (("offloaded", offloads), ("fetched", fetches)):
        twice = sorted(k for k, n in Counter(keys).items() if n > 1)
        if twice:
            problems.append(f"step: saved inputs {what} twice: {twice[:4]}")
    if slots:
        problems.append(f"step: ends with slot(s) {sorted(slots)} holding inputs never fetched")
    return problems
