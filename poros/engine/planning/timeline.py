"""A plan's step on an ideal host: its operations on the device's two queues, the host->device link and the compute
stream, each in the plan's order and ordered across by the plan's events (a load waits for its buffer's release, a
layer for its buffer's load, a backward for its saved input's fetch), every launch at no cost. Its step time, the
plan's schedule floor, is what the plan's order allows the device: at least the larger of its copy and compute
floors, more where the link idles because every buffer holds a block still to be read (the blocks a step reuses
across its ends, resident layers computing with nothing left to load) or the compute waits for a load. What a
measured step takes beyond it is the host's.

The costs come from a measured run: the link's bytes per second (its probe) and the step of the same work with
nothing streamed (the compute floor), shared among the layers, the head and their passes in proportion to their
matmul FLOPs (`CostModel.of`): a layer's forward 2 x tokens x its weights plus causal attention's 2 x tokens^2 x
query width; its backward the forward again (the recompute; none for a layer that keeps its activations), twice its
linear FLOPs and 2.5 times its attention's; the head's forward and the gradient of its input, 4 x tokens x hidden x
vocab. The copies of saved inputs share the link with the weights' in the plan's order; their copies out run the
other way and cost nothing here."""

from __future__ import annotations

from dataclasses import dataclass

from poros.engine.planning import plan as P
from poros.engine.planning.geometry import Geometry

ATTENTION_BACKWARD = 2.5  # attention's backward FLOPs over its forward's (dQ, dK, dV and the recomputed scores)
STEPS = 3  # steps simulated: the first starts from the set-up, the last two from a step's end (the steady state)


@dataclass(frozen=True)
class CostModel:
    """Seconds of one layer's forward and backward (per layer), the head's, and seconds per byte over the link."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]  # with its recompute, where the layer recomputes
    head_s: float
    link_s_per_byte: float

    @classmethod
    def of(cls, plan: P.Plan, geo: Geometry, tokens: int, seq_len: int, compute_floor_s: float,
           link_bytes_per_s: float) -> "CostModel":
        """Costs for `plan` whose step of the same work with nothing streamed took `compute_floor_s`, every layer but
        the plan's kept ones recomputed, over a link of `link_bytes_per_s` (`tokens`: a micro-batch's, `seq_len` its
        sequences' length; every micro-batch of a step alike).

        Raises:
            ValueError: a floor or link that is not a positive number.
        """
        if not compute_floor_s > 0 or not link_bytes_per_s > 0:
            raise ValueError(f"a compute floor and a link rate must be positive, got {compute_floor_s} s and "
                             f"{link_bytes_per_s} B/s")
        kept = set(plan.kept_layers)
        attention = 2.0 * tokens * seq_len * geo.q_width  # causal: half of the scores' and the values' 4 t^2 d
        # a layer's matmul FLOPs: 2 a token for each of its weights, two NF4 weights a byte
        linear = [2.0 * tokens * 2 * (end - start) for start, end in zip(geo.layer_starts, geo.layer_ends)]
        forward = [x + attention for x in linear]
        backward = [(0.0 if i in kept else f) + 2 * x + ATTENTION_BACKWARD * attention
                    for i, (x, f) in enumerate(zip(linear, forward))]
        head = 4.0 * tokens * geo.hidden * geo.vocab
        per_step = plan.grad_accum * (sum(forward) + sum(backward) + head)
        scale = compute_floor_s / per_step
        return cls(tuple(x * scale for x in forward), tuple(x * scale for x in backward), head * scale,
                   1.0 / link_bytes_per_s)


@dataclass(frozen=True)
class Timeline:
    """One steady step of a plan on an ideal host (seconds)."""

    step_s: float  # the schedule floor: a step's time, from the end of one to the end of the next
    copy_s: float  # the link's busy time in it (its bytes over the link)
    compute_s: float  # the compute stream's busy time in it
    link_idle_s: float  # step_s less copy_s: where nothing is copied in
    compute_wait_s: float  # step_s less compute_s: where the compute waits for a load


def simulate(plan: P.Plan, costs: CostModel) -> Timeline:
    """`plan`'s set-up, then STEPS steps, each operation at the earliest its queue and its events allow; the last
    step's times.

    Raises:
        ValueError: a plan whose copies are shared among ranks (gathers: not modelled).
    """
    if plan.shards > 1:
        raise ValueError("a plan whose copies are shared among ranks is not modelled")
    groups = plan.groups
    link = compute = 0.0  # when each queue is next free
    ready: dict[int, float] = {}  # buffer (P.HEAD_SLOT: the lm_head's region) -> end of its last load
    free: dict[int, float] = {}  # buffer -> its last release
    fetched: dict[tuple[int, int], float] = {}  # (layer, micro) -> end of its saved input's copy back
    busy = {"link": 0.0, "compute": 0.0}
    ends = []

    def copy(nbytes: int, after: float) -> float:
        nonlocal link
        start = max(link, after)
        link = start + nbytes * costs.link_s_per_byte
        busy["link"] += link - start
        return link

    def run(seconds: float, after: float) -> None:
        nonlocal compute
        compute = max(compute, after) + seconds
        busy["compute"] += seconds

    def buffer_of(op: P.Op) -> int:
        return groups[op.group].buffer

    for op in plan.setup:
        if op.kind == P.LOAD:
            ready[op.buffer] = copy(groups[op.group].nbytes, free.get(op.buffer, 0.0))
    if plan.head_resident:
        ready[P.HEAD_SLOT] = copy(plan.head_bytes, 0.0)
    for _ in range(STEPS):
        busy = {"link": 0.0, "compute": 0.0}
        begin = compute
        for op in plan.step:
            kind = op.kind
            if kind == P.LOAD:
                ready[op.buffer] = copy(groups[op.group].nbytes, free.get(op.buffer, 0.0))
            elif kind == P.LOAD_HEAD:
                lent = free.get(op.buffer, 0.0) if op.buffer >= 0 else 0.0
                ready[P.HEAD_SLOT] = copy(plan.head_bytes, max(lent, free.get(P.HEAD_SLOT, 0.0)))
            elif kind in (P.RELEASE, P.RELEASE_HEAD):
                free[P.HEAD_SLOT if kind == P.RELEASE_HEAD else op.buffer] = compute
                if kind == P.RELEASE_HEAD and op.buffer >= 0:
                    free[op.buffer] = compute
            elif kind == P.FETCH:
                fetched[(op.layer, op.micro)] = copy(plan.input_bytes, compute)
            elif kind in (P.FORWARD, P.REGEN):
                run(costs.forward_s[op.layer], ready.get(buffer_of(op), 0.0))
            elif kind == P.BACKWARD:
                run(costs.backward_s[op.layer], max(ready.get(buffer_of(op), 0.0),
                                                    fetched.pop((op.layer, op.micro), 0.0)))
            elif kind == P.HEAD:
                run(costs.head_s, ready.get(P.HEAD_SLOT, 0.0))
            elif kind in (P.GATHER, P.GATHER_HEAD):
                raise ValueError("a plan whose copies are shared among ranks is not modelled")
            # OFFLOAD: device->host, the link's other direction, ordered after the forward that made its input
        ends.append(compute - begin)
    step = ends[-1]
    return Timeline(step_s=step, copy_s=busy["link"], compute_s=busy["compute"],
                    link_idle_s=max(0.0, step - busy["link"]), compute_wait_s=max(0.0, step - busy["compute"]))
