"""Plans from requests: `PlanRequest` is what a run asks of the planner, `build_plan` makes the plan a request
describes (its groups, buffers and the operations of a steady-state step). The searches within a budget, and
the plan a run's config asks for, are poros/engine/planning/budget.py's."""

from __future__ import annotations

from dataclasses import dataclass

from poros.choices import Accumulation, Device, Placement
from poros.config import TrainConfig
from poros.engine.planning import regen
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.inputs import (
    HostMemory,
    host_budget,
    host_layers,
    input_ops,
    saved_bytes,
    slot_bytes,
)
from poros.engine.planning.memory import (
    DeviceMemory,
    Memory,
    ProcessCosts,
    attention_parts,
    auto_budget,
    compiled_transient,
    counted_attention,
    counted_attention_chunk,
    graph_pool_bytes,
    layer_activation_bytes,
    lora_bytes,
    template_bytes,
    template_static_bytes,
    transient_bytes,
)
from poros.engine.planning.plan import (
    BACKWARD,
    FORWARD,
    GATHER,
    GATHER_HEAD,
    HEAD,
    HEAD_SLOT,
    LOAD,
    LOAD_HEAD,
    RELEASE,
    RELEASE_HEAD,
    Buffer,
    Group,
    Op,
    Plan,
    gathered_size,
)
from poros.engine.planning.rules import check
from poros.errors import CapabilityError
from poros.store.layout import align
from poros.sizes import is_auto


def _evenly(n: int, k: int) -> list[int]:
    """k of the positions 0..n-1, spread evenly from 0."""
    return [j * n // k for j in range(k)]


def resident_set(n_layers: int, resident: int, placement: Placement) -> tuple[int, ...]:
    """Which `resident` of `n_layers` layers stay on the device: the last ones (tail: they are used at the
    turn from forward to backward) or all but `n_layers - resident` streamed layers spread evenly from layer 0
    (spread: between two streamed layers sit resident ones, whose forward the next copy runs behind)."""
    if not 0 <= resident <= n_layers:
        raise ValueError(f"resident_layers: expected 0..{n_layers}, got {resident}")
    streamed = n_layers - resident
    if placement is Placement.TAIL or streamed in (0, n_layers):
        return tuple(range(streamed, n_layers))
    out = set(_evenly(n_layers, streamed))
    return tuple(i for i in range(n_layers) if i not in out)


def kept_set(resident: tuple[int, ...], count: int | None) -> tuple[int, ...]:
    """Which resident layers keep their activations: all of them, or `count` spread evenly among them."""
    if count is None or count >= len(resident):
        return resident
    return tuple(resident[j] for j in _evenly(len(resident), count))


def _groups(geo: Geometry, resident: frozenset, block: int) -> list[Group]:
    """The layers in order as groups: each run of consecutive streamed layers in groups of `block`, each run
    of resident layers one group. Buffers are numbered in order of first use, streamed and resident apart
    (`_place` maps them onto the rotating buffers and the resident regions)."""
    out, runs, count = [], [], {False: 0, True: 0}
    for i in range(geo.n_layers):
        if runs and runs[-1][2] == (i in resident):
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1, i in resident])
    for first, stop, is_resident in runs:
        chunks = [(first, stop)] if is_resident else [(f, min(f + block, stop)) for f in range(first, stop, block)]
        for f, e in chunks:
            out.append(Group(len(out), f, e, geo.layer_starts[f], geo.layer_ends[e - 1], count[is_resident],
                             is_resident))
            count[is_resident] += 1
    return out


def _place(groups: list[Group], n_stream: int) -> list[Group]:
    """Streamed group k into rotating buffer k mod n_stream; resident group j into region n_stream + j."""
    return [Group(g.index, g.first, g.stop, g.start, g.end,
                  n_stream + g.buffer if g.resident else g.buffer % n_stream, g.resident) for g in groups]


def _step_ops(groups: list[Group], grad_accum: int, order: Accumulation, head_buffer: int | None,
              head_resident: bool, holds: dict[int, int], shards: int = 1,
              n_stream: int = 2) -> tuple[list[Op], dict[int, int]]:
    """One optimizer step from buffer state `holds` (buffer -> group or HEAD_SLOT); returns the ops and
    the state they leave. A streamed group's load is enqueued when the streamed group `n_stream - 1` before it
    in the pass starts (each of the `n_stream` rotating buffers was released by then: its previous contents were
    read by an earlier group), so the copy runs while the compute stream works on the groups between and on
    any resident layers among them. With `shards` ranks each
    load of a streamed group (or of the lm_head) is this rank's share, its gather follows at once: the gather
    runs behind the copy on a stream of its own, the compute stream waits for the gather."""
    holds = dict(holds)
    ops: list[Op] = []
    stream = [g for g in groups if not g.resident]

    def load(g: Group) -> None:
        if holds.get(g.buffer) != g.index:
            ops.append(Op(LOAD, group=g.index, buffer=g.buffer))
            if shards > 1:
                ops.append(Op(GATHER, group=g.index, buffer=g.buffer))
            holds[g.buffer] = g.index

    def load_head() -> None:
        ops.append(Op(LOAD_HEAD, buffer=head_buffer))
        if shards > 1:
            ops.append(Op(GATHER_HEAD, buffer=head_buffer))
        holds[head_buffer] = HEAD_SLOT

    def passes(micros, forward: bool) -> None:
        seq = groups if forward else groups[::-1]
        streamed = [g for g in seq if not g.resident]
        ahead = {g.index: streamed[k + 1: k + n_stream] for k, g in enumerate(streamed)}
        for g in seq:
            if not g.resident:
                load(g)  # already there when prefetched, or left by the previous pass
                for nxt in ahead[g.index]:
                    if nxt.buffer != g.buffer:
                        load(nxt)  # prefetch into another buffer, released by a streamed group before this one
            if forward and head_buffer is not None and not head_resident and g is stream[-1]:
                load_head()  # the buffer of the streamed group before the last
            layers = g.layers if forward else reversed(g.layers)
            for i in layers:
                for m in micros:
                    ops.append(Op(FORWARD if forward else BACKWARD, layer=i, micro=m, group=g.index))
            ops.append(Op(RELEASE, group=g.index, buffer=g.buffer))

    def head(micros) -> None:
        if head_buffer is not None and not head_resident and not stream:
            load_head()
        for m in micros:
            ops.append(Op(HEAD, micro=m))
        if not head_resident:
            ops.append(Op(RELEASE_HEAD, buffer=-1 if head_buffer is None else head_buffer))

    batches = [[m] for m in range(grad_accum)] if order is Accumulation.MICRO else [list(range(grad_accum))]
    for micros in batches:
        passes(micros, forward=True)
        head(micros)
        passes(micros, forward=False)
    return ops, holds


@dataclass(frozen=True)
class PlanRequest:
    """What a run asks of the planner: its settings (`config`, read as they are), and what `of_config` derives
    from the device it runs on. `build_plan` makes the plan that keeps `resident_layers` (and, with
    `head_resident`, the lm_head) on the device, and the saved inputs of the last `device_inputs` recomputed layers
    (None: as `config` asks: with `offload_inputs`, its `device_inputs`, by default none; without, all);
    `plan_for_budget` searches the block size, the residency, the lm_head's place and (unless `config.offload_inputs`
    places them) the saved inputs' place for the plan that copies the fewest bytes within `budget`, its host
    memory within `host_budget`."""

    config: TrainConfig
    resident_layers: int = 0
    head_resident: bool | None = None  # None: resident unless two buffers rotate
    budget: int | None = None  # bytes of the process's device memory; recorded on the plan, fitted by `plan_for_budget`
    process: ProcessCosts = ProcessCosts()  # what the process holds beside the allocator's tensors
    shards: int = 1  # ranks sharing every streamed copy (shard_stream); see Plan.shards
    device_inputs: int | None = None  # recomputed layers whose saved inputs stay on the device (None: as config says)
    host_budget: int | None = None  # bytes of host memory for the NF4 store and the saved inputs there (None: unchecked)
    regenerated: int | None = None  # the most layers whose inputs are regenerated (None: as config says)

    @classmethod
    def of_config(cls, cfg: TrainConfig, device: DeviceMemory | None = None, ranks: int | None = None,
                  host: HostMemory | None = None) -> PlanRequest:
        """The request `cfg` makes: on a CUDA device for the whole process (its context measured in `device`
        where given, NCCL's buffers for several ranks); `vram_budget: auto` is what `device` has free
        (`auto_budget`); `ranks`, the data-parallel ranks running it (default `cfg.gpus`), share every streamed
        copy under `shard_stream`; `host_budget: auto` is what `host` has free (inputs.host_budget).

        Raises:
            CapabilityError: `vram_budget: auto` without a device to measure.
        """
        budget = cfg.vram_budget
        if is_auto(budget):
            if device is None:
                raise CapabilityError("vram_budget auto needs a CUDA device to measure its free memory; give a size")
            budget = auto_budget(device)
        ranks = ranks or cfg.gpus
        process = (ProcessCosts.cuda(ranks, device.context if device else None, device.allocated if device else 0)
                   if cfg.device is Device.CUDA else ProcessCosts())
        return cls(cfg, budget=budget, process=process, shards=ranks if cfg.shard_stream else 1,
                   host_budget=host_budget(cfg.host_budget, host, cfg.device is Device.CUDA))


def build_plan(geo: Geometry, request: PlanRequest, checked: bool = True) -> Plan:
    """The plan keeping `resident_layers` layers (the last ones, or with `placement` spread, all but evenly
    spread streamed ones) and, with `head_resident`, the lm_head on the device for good and streaming the
    rest in groups of `block_size` through `stream_buffers` rotating buffers; with `keep_activations` the resident
    layers (at most `kept_layers` of them, spread evenly) keep their activations instead of recomputing them;
    the saved inputs of all but the last `device_inputs` recomputed layers go through host memory.

    `checked`: the plan is held to every rule (`assert_valid`); a search that builds many candidates holds the
    one it returns."""
    r, c = request, request.config
    block_size, grad_accum, accumulation, seq_len, batch_size = (c.block_size, c.grad_accum, c.accumulation,
                                                                  c.seq_len, c.batch_size)
    resident_layers, head_resident, attention, offload_inputs = (r.resident_layers, r.head_resident, c.attention,
                                                                 c.offload_inputs)
    graphs = c.cuda_graphs
    n = geo.n_layers
    overlap = c.backward_overlaps
    resident_order = resident_set(n, resident_layers, c.placement)
    resident = frozenset(resident_order)
    streamed = n - resident_layers
    block = max(1, min(block_size, streamed)) if streamed else block_size
    groups = _groups(geo, resident, block)
    n_groups = sum(not g.resident for g in groups)  # streamed groups
    n_stream = min(c.stream_buffers, n_groups)
    groups = _place(groups, n_stream)
    shards = r.shards
    stream_size = align(max((gathered_size(g.nbytes, shards) for g in groups if not g.resident), default=0))
    # the lm_head borrows the buffer of the streamed group before the last (idle during the head) where two or
    # more rotate; else it is resident
    if head_resident is None:
        head_resident = n_stream < 2
    head_buffer = None
    if not head_resident and n_stream >= 2:
        head_buffer = (n_groups - 2) % n_stream
    elif not head_resident:
        head_resident = True  # a region of its own would be held all step: keep the lm_head there
    head_pad = align(max(0, gathered_size(geo.head_bytes, shards) - stream_size)) if head_buffer is not None else 0
    buffers = [Buffer(b, stream_size, False) for b in range(n_stream)]
    buffers += [Buffer(g.buffer, align(g.nbytes), True) for g in groups if g.resident]
    # steady state: run one step from empty buffers, then plan every step from where it ends
    _, end = _step_ops(groups, grad_accum, accumulation, head_buffer, head_resident, {}, shards, n_stream)
    step, after = _step_ops(groups, grad_accum, accumulation, head_buffer, head_resident, end, shards, n_stream)
    setup = [Op(LOAD, group=g.index, buffer=g.buffer) for g in groups if g.resident]
    for b, grp in sorted(end.items()):
        if grp != HEAD_SLOT and not groups[grp].resident:
            setup.append(Op(LOAD, group=grp, buffer=b))
            if shards > 1:
                setup.append(Op(GATHER, group=grp, buffer=b))
    live = grad_accum if accumulation is Accumulation.LAYER else 1  # micro-batches whose inputs are kept at once
    one_input = seq_len * batch_size * geo.hidden * 2
    parts = (one_input, *(attention_parts(geo, seq_len, batch_size) if c.keep_attention else ()))
    one_saved = sum(parts)  # what one recompute needs saved: its input, with kept attention its results
    # offloaded: inputs back on the device ahead of their backward, one block's worth. A copy back starts once
    # the compute stream reaches its fetch, a backward before (poros/engine/runtime/saved_inputs.py), and has that
    # backward's time: a layer's recompute and backward take more than 2 x 6 x hidden^2 FLOPs a token where its
    # copy moves 2 x hidden bytes (with kept attention about twice that), tens of times shorter on any GPU that
    # streams weights.
    window = block * live
    head_t, layer_t = transient_bytes(geo, seq_len, batch_size, counted_attention(attention, c.compile), overlap,
                                      c.loss_chunk, c.deterministic,
                                      c.mlp_chunk, counted_attention_chunk(c.compile, c.compile_mlp, c.attention_chunk))
    # keep_activations auto keeps none here: the budget search gives a plan its kept layers (budget.py)
    kept = kept_set(resident_order, c.kept_layers) if c.keep_activations is True else ()
    device_inputs = r.device_inputs if r.device_inputs is not None else (
        (c.device_inputs or 0) if offload_inputs else None)
    segs = regen.segments([i for i in range(n) if i not in kept], c.input_stride, {i: g for g in groups for i in g.layers},
                          regen.present_at_backwards(setup, step), grad_accum)
    limit = r.regenerated if r.regenerated is not None else (
        c.regenerated_layers if isinstance(c.regenerated_layers, int) else None)  # auto: the search sets it
    segs = regen.thin(segs, limit)
    regenerated = tuple(i for seg in segs for i in seg[1:])
    alive = regen.alive_at_once(segs, live)
    step = regen.regen_ops(step, segs, {i: g for g in groups for i in g.layers})
    host = host_layers(n, kept, device_inputs, regenerated)
    on_device = n - len(kept) - len(host) - len(regenerated)
    # regenerated inputs: none saved in forward; in backward a segment's at once beside the saved ones
    saved = saved_bytes(n - len(regenerated), on_device, len(host), live, window, one_saved) + alive * one_saved
    grads_in_flight = (grad_accum if accumulation is Accumulation.LAYER else 1) * seq_len * batch_size * geo.hidden * 2
    memory = Memory(
        weight_buffers=sum(b.nbytes for b in buffers if not b.resident) + head_pad,
        resident_weights=sum(b.nbytes for b in buffers if b.resident) + (geo.head_bytes if head_resident else 0),
        lora=lora_bytes(geo, c.lora_rank), dense=geo.dense_device_bytes, saved_inputs=saved,
        transient=max(head_t, compiled_transient(layer_t + grads_in_flight, c.compile, c.compile_mlp)),
        # streamed layers share 2 x block_size templates (their LoRA copies within the measured peaks the
        # model is fitted to), and block_size more per rotating buffer beyond two; every resident layer has its
        # own weights' addresses, so its own templates; a kept layer has a template of its own per micro-batch
        # kept at once, with its own input
        templates=((resident_layers - len(kept) + max(0, n_stream - 2) * block) * template_bytes(geo, c.lora_rank)
                   + len(kept) * live * (template_bytes(geo, c.lora_rank) + one_input)
                   + template_static_bytes(geo, seq_len, batch_size)) if graphs else 0,
        kept_activations=len(kept) * live * layer_activation_bytes(geo, seq_len, batch_size, attention, c.mlp_chunk,
                                                                        c.attention_chunk),
        graph_pool=graph_pool_bytes(layer_t, c.compile, kept=bool(kept)) if graphs else 0).with_costs(r.process)
    plan = Plan(geo.name, n, block, grad_accum, accumulation, tuple(groups), tuple(buffers), head_resident, head_buffer,
                head_pad, geo.head_bytes, tuple(setup), tuple(input_ops(step, host, live, window, regenerated)), memory, r.budget,
                host_inputs=host, input_bytes=one_saved, input_slot=slot_bytes(parts), input_window=window,
                store_bytes=geo.store_bytes, host_budget=r.host_budget, keep_attention=c.keep_attention,
                kept_layers=kept, shards=shards, input_stride=c.input_stride, regenerated=regenerated,
                regenerated_alive=alive)
    if after != end:
        raise AssertionError("planner produced an invalid plan: not a steady state")
    return assert_valid(plan) if checked else plan


def assert_valid(plan: Plan) -> Plan:
    """`plan`, once it breaks no rule (poros/engine/planning/rules.py).

    Raises:
        AssertionError: naming the rules it breaks (a planner bug, never a user's error).
    """
    problems = check(plan)
    if problems:
        raise AssertionError(f"planner produced an invalid plan: {problems}")
    return plan
