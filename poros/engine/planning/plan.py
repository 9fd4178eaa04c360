"""A plan as data: where every decoder layer's NF4 bytes live on the device (a resident region, loaded
once, or a streamed group that takes turns in a rotating buffer), where each layer's saved input lives
(the device, or host memory), and the ordered operations of one optimizer step: load a group into its
buffer, forward a layer for a micro-batch, the head, recompute and backward a layer, release a buffer, and
for a saved input in host memory its copy out (offload) and back (fetch) through its slot of the host
arena, and with `input_stride` the no-grad forwards that regenerate in backward the inputs of the layers
between two saved ones (poros/engine/planning/regen.py). The executor (poros/engine/methods/executor.py) runs any plan and derives every stream ordering from it;
`describe` is its text in `poros plan`."""

from __future__ import annotations

from dataclasses import dataclass

from poros.choices import Accumulation
from poros.engine.planning.memory import Memory, gb
from poros.sizes import format_size
from poros.store.layout import align

LOAD, RELEASE, FORWARD, HEAD, BACKWARD, LOAD_HEAD, RELEASE_HEAD = (
    "load", "release", "forward", "head", "backward", "load_head", "release_head")
GATHER, GATHER_HEAD = "gather", "gather_head"  # the other ranks' shares of the load before (shard_stream)
OFFLOAD, FETCH = "offload", "fetch"  # a saved input device->host into its slot, and back host->device
REGEN = "regenerate"  # layer L's forward again, no grad, from its input: the input of layer L + 1 (input_stride)
HEAD_SLOT = -1  # what a buffer lent to the lm_head weight holds


@dataclass(frozen=True)
class Op:
    kind: str
    layer: int = -1
    micro: int = -1
    group: int = -1
    buffer: int = -1

    def __str__(self) -> str:
        parts = [self.kind]
        if self.group >= 0:
            parts.append(f"g{self.group}")
        if self.layer >= 0:
            parts.append(f"L{self.layer}")
        if self.micro >= 0:
            parts.append(f"m{self.micro}")
        if self.buffer >= 0:
            parts.append(f"{'s' if self.kind in (OFFLOAD, FETCH) else 'b'}{self.buffer}")
        return ":".join(parts)


@dataclass(frozen=True)
class Group:
    """Consecutive layers that move as one copy (one contiguous arena range)."""

    index: int
    first: int
    stop: int
    start: int  # arena byte range
    end: int
    buffer: int
    resident: bool

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def layers(self) -> range:
        return range(self.first, self.stop)


@dataclass(frozen=True)
class Buffer:
    index: int
    nbytes: int
    resident: bool  # loaded once, never refilled


@dataclass(frozen=True)
class Plan:
    model: str
    n_layers: int
    block_size: int
    grad_accum: int
    accumulation: Accumulation
    groups: tuple[Group, ...]
    buffers: tuple[Buffer, ...]
    head_resident: bool
    head_buffer: int | None  # stream buffer the lm_head borrows (None: its own region)
    head_pad: int  # bytes the borrowed buffer is extended by when the lm_head is larger
    head_bytes: int
    setup: tuple[Op, ...]  # run once: resident loads and the state every step starts from
    step: tuple[Op, ...]
    memory: Memory
    budget: int | None = None
    # saved layer inputs: kept on the device, or, for the layers in `host_inputs`, copied to host memory in
    # forward (device->host, the direction the weights leave idle) and back ahead of their backward, the
    # fetches `input_window` backward operations ahead (poros/engine/planning/inputs.py)
    host_inputs: tuple[int, ...] = ()
    input_bytes: int = 0  # what one recompute needs saved (one layer, one micro-batch): input, kept attention
    input_slot: int = 0  # host bytes of one saved input's slot: its tensors, each aligned
    input_window: int = 0
    store_bytes: int = 0  # the NF4 store in host memory, beside the saved inputs there
    host_budget: int | None = None  # bytes of host memory for both (None: unchecked)
    keep_attention: bool = False  # recomputed layers save their attention's results with their input
    # resident layers that keep their activations from forward to backward: no recompute, resident
    # QLoRA's own forward with autograd and its backward from the kept output
    kept_layers: tuple[int, ...] = ()
    # data-parallel ranks that share every streamed copy (shard_stream): each loads one contiguous share of
    # a group's (or the streamed lm_head's) bytes and a gather brings the others'; 1: each rank copies all
    shards: int = 1
    # input_stride: what was asked, and the recomputed layers that save no input, theirs regenerated in backward
    # (poros/engine/planning/regen.py); `regenerated_alive`: the most of their inputs on the device at once
    input_stride: int = 1
    regenerated: tuple[int, ...] = ()
    regenerated_alive: int = 0

    def shard_size(self, nbytes: int) -> int:
        return shard_size(nbytes, self.shards)

    def shard(self, nbytes: int, rank: int) -> tuple[int, int]:
        """The byte range [lo, hi) of an `nbytes` copy that `rank` loads from host memory (empty past the end)."""
        s = self.shard_size(nbytes)
        return min(rank * s, nbytes), min((rank + 1) * s, nbytes)

    def gathered_size(self, nbytes: int) -> int:
        return gathered_size(nbytes, self.shards)

    @property
    def offload_inputs(self) -> bool:
        """Whether any saved input goes through host memory."""
        return bool(self.host_inputs)

    @property
    def live_inputs(self) -> int:
        """Micro-batches whose saved inputs of one layer are kept at once: every one, layer-major; one, micro-major."""
        return self.grad_accum if self.accumulation is Accumulation.LAYER else 1

    @property
    def host_slots(self) -> int:
        """Slots of the host's saved-input arena: one per host-held layer and live micro-batch."""
        return len(self.host_inputs) * self.live_inputs

    @property
    def host_input_bytes(self) -> int:
        """Host bytes of the saved-input arena (exact: allocated at this size and page-locked in place)."""
        return self.host_slots * self.input_slot

    @property
    def host_bytes(self) -> int:
        """The plan's host memory: the NF4 store and the saved-input arena."""
        return self.store_bytes + self.host_input_bytes

    @property
    def device_input_layers(self) -> list[int]:
        """Recomputed layers whose saved inputs stay on the device."""
        skip = {*self.host_inputs, *self.kept_layers, *self.regenerated}
        return [i for i in range(self.n_layers) if i not in skip]

    @property
    def regenerations_per_step(self) -> int:
        """Extra layer forwards of one step: those regenerating inputs in backward."""
        return sum(op.kind == REGEN for op in self.step)

    @property
    def graph_pool(self) -> int:
        return self.memory.graph_pool

    @property
    def resident_layers(self) -> list[int]:
        return [i for g in self.groups if g.resident for i in g.layers]

    @property
    def streamed_layers(self) -> list[int]:
        return [i for g in self.groups if not g.resident for i in g.layers]

    @property
    def group_of(self) -> dict[int, Group]:
        return {i: g for g in self.groups for i in g.layers}

    def _op_nbytes(self, op: Op) -> int:
        return self.groups[op.group].nbytes if op.kind in (LOAD, GATHER) else self.head_bytes

    def op_bytes(self, op: Op, rank: int = 0) -> int:
        """Bytes `op` copies host->device on `rank` (its share, when the copy is sharded)."""
        if op.kind not in (LOAD, LOAD_HEAD):
            return 0
        nbytes = self._op_nbytes(op)
        if self.shards == 1 or op.kind == LOAD and self.groups[op.group].resident:
            return nbytes
        lo, hi = self.shard(nbytes, rank)
        return hi - lo

    def gather_bytes(self, op: Op) -> int:
        """Bytes a gather brings a rank from the others (their padded shares)."""
        if op.kind not in (GATHER, GATHER_HEAD):
            return 0
        return (self.shards - 1) * self.shard_size(self._op_nbytes(op))

    @property
    def h2d_bytes_per_step(self) -> int:
        """Host->device bytes of one step on rank 0 (with shards, the rank whose share is never short): the weights'
        loads and every host-held saved input brought back once per micro-batch."""
        return sum(self.op_bytes(op) for op in self.step) + self.d2h_bytes_per_step

    @property
    def gathered_bytes_per_step(self) -> int:
        """Bytes of one step each rank receives from the other ranks' shares (0 without shards)."""
        return sum(self.gather_bytes(op) for op in self.step)

    @property
    def d2h_bytes_per_step(self) -> int:
        """Device->host bytes of one step: every host-held saved input, once per micro-batch (from the placement;
        the rules hold the offload and fetch operations to it)."""
        return len(self.host_inputs) * self.grad_accum * self.input_bytes

    @property
    def loads_per_step(self) -> int:
        return sum(op.kind == LOAD for op in self.step)

    def summary(self) -> dict:
        """What `poros plan --json` prints and results rows record."""
        return {
            "model": self.model, "block_size": self.block_size, "grad_accum": self.grad_accum,
            "accumulation": self.accumulation.value, "n_layers": self.n_layers,
            "resident_layers": self.resident_layers, "streamed_layers": self.streamed_layers,
            "kept_layers": list(self.kept_layers),
            "head_resident": self.head_resident, "h2d_bytes_per_step": self.h2d_bytes_per_step,
            "d2h_bytes_per_step": self.d2h_bytes_per_step, "offload_inputs": self.offload_inputs,
            "host_inputs": list(self.host_inputs), "device_inputs": len(self.device_input_layers),
            "host_input_bytes": self.host_input_bytes, "host_bytes": self.host_bytes, "host_budget": self.host_budget,
            "input_stride": self.input_stride, "regenerated_layers": list(self.regenerated),
            "regenerations_per_step": self.regenerations_per_step, "shards": self.shards, "gathered_bytes_per_step": self.gathered_bytes_per_step,
            "loads_per_step": self.loads_per_step, "peak_vram_bytes": self.memory.allocated,
            "process_vram_bytes": self.memory.total, "memory": self.memory.parts(), "vram_budget": self.budget,
            "graph_pool_bytes": self.graph_pool,
            "buffers": [{"index": b.index, "bytes": b.nbytes, "resident": b.resident} for b in self.buffers],
        }


def shard_size(nbytes: int, shards: int) -> int:
    """Bytes of one rank's share of an `nbytes` copy split over `shards` ranks: equal shares, each aligned
    (the last one padded), as an all-gather needs them."""
    return align(-(-nbytes // shards)) if shards > 1 else nbytes


def gathered_size(nbytes: int, shards: int) -> int:
    """Device bytes a sharded copy spans with its padding: every rank's share, what the gather fills (the
    gather runs in place: each rank's share is its own slice of the buffer it receives the others' into)."""
    return shards * shard_size(nbytes, shards)


def _ranges(xs: list[int]) -> str:
    """Sorted layer indices as runs: `0-23`, or `0, 4-5, 9` for a spread placement."""
    runs: list[list[int]] = []
    for x in xs:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


BESIDE_TENSORS = {  # the parts of a process's device memory that are not the allocator's tensors
    "graph_pool": "reserved by CUDA graphs: the layer templates' intermediates",
    "allocator_reserve": "the caching allocator's reserve beyond its tensors",
    "context": "CUDA context, kernel modules, library handles",
    "nccl": "NCCL's buffers",
}


def _describe_inputs(plan: Plan, span) -> list[str]:
    """Where the saved inputs live, and the plan's host memory."""
    what = f"saved layer inputs{' and attention results' if plan.keep_attention else ''}"
    if not plan.host_inputs:
        return [f"  {what}: device"]
    budget = "unchecked" if plan.host_budget is None else f"host budget {format_size(plan.host_budget)}"
    where = (f"device for layers {span(plan.device_input_layers)}, host memory for {span(list(plan.host_inputs))}"
             if plan.device_input_layers else "host memory")
    return [f"  {what}: {where} (device->host in forward, back {plan.input_window} backward operations ahead)",
            f"  host memory: NF4 store {gb(plan.store_bytes)} + saved inputs {gb(plan.host_input_bytes)} "
            f"({plan.host_slots} slots, page-locked) = {gb(plan.host_bytes)} ({budget})"]


def _describe_stride(plan: Plan) -> list[str]:
    """What `input_stride` saves and costs."""
    if plan.input_stride == 1:
        return []
    saved = plan.n_layers - len(plan.kept_layers) - len(plan.regenerated)
    return [f"  input stride {plan.input_stride}: inputs saved for {saved} of {saved + len(plan.regenerated)} "
            f"recomputed layers, {len(plan.regenerated)} regenerated in backward: {plan.regenerations_per_step} extra "
            f"layer forwards per optimizer step, no extra weight bytes (each from weights already on the device), "
            f"up to {plan.regenerated_alive} regenerated inputs on the device at once "
            f"({gb(plan.regenerated_alive * plan.input_bytes)})"]


def describe(plan: Plan) -> str:
    """`poros plan`'s text: residency, bytes per step and the process's predicted peak by part."""
    res, st = plan.resident_layers, plan.streamed_layers
    span = lambda xs: "none" if not xs else f"{_ranges(xs)} ({len(xs)})"  # noqa: E731
    lines = [
        f"plan for {plan.model}: {plan.n_layers} layers, block size {plan.block_size}, grad_accum {plan.grad_accum}"
        + (f" ({plan.accumulation.value}-major)" if plan.grad_accum > 1 else ""),
        f"  streamed layers:  {span(st)}" + (f" through {rotating} rotating buffers" if (
            rotating := sum(not b.resident for b in plan.buffers)) > 2 else ""),
        f"  resident layers:  {span(res)}" + (
            "" if not plan.kept_layers else " (activations kept: no recompute)" if len(plan.kept_layers) == len(res)
            else f" (activations kept, no recompute: {span(list(plan.kept_layers))})"),
        f"  lm_head:          {'resident' if plan.head_resident else f'streamed into buffer {plan.head_buffer}'}",
        f"  host->device per optimizer step: {gb(plan.h2d_bytes_per_step)} ({plan.loads_per_step} group loads"
        + (f", saved inputs back: {gb(plan.d2h_bytes_per_step)})" if plan.offload_inputs else ")"),
        *([f"  shared stream over {plan.shards} ranks: each rank copies its 1/{plan.shards} of every streamed "
           f"block from host memory (above: rank 0's) and all-gathers {gb(plan.gathered_bytes_per_step)} per "
           "optimizer step from the others, in place into the stream buffers"] if plan.shards > 1 else []),
        *_describe_inputs(plan, span),
        *_describe_stride(plan),
    ]
    m = plan.memory
    parts = m.parts()
    lines.append(f"  predicted peak device memory of the process: {gb(m.total)}"
                 + (f" (budget {format_size(plan.budget)})" if plan.budget else ""))
    lines.append(f"    {'tensors':21s} {gb(m.allocated)} (allocated)")
    lines += [f"      {k:19s} {gb(v)}" for k, v in parts.items() if k not in BESIDE_TENSORS]
    lines += [f"    {k:21s} {gb(parts[k])} ({what})" for k, what in BESIDE_TENSORS.items() if parts[k]]
    return "\n".join(lines)
