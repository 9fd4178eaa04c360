"""The planner: a model's shapes and a run's settings in, a plan out.

A plan is data: where every decoder layer's NF4 bytes live on the device (a resident region, loaded
once, or a streamed group that takes turns in a rotating buffer), and the ordered operations of one
optimizer step: load a group into its buffer, forward a layer for a micro-batch, the head, recompute
and backward a layer, release a buffer. The executor (poros/engine/executor.py) runs any plan and derives
every stream ordering from it; the rules in `check` are properties of the plan alone, so they are
tested without a GPU:

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
    gather, which writes the buffer as a load does, never comes before the release after the last read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from poros.errors import BudgetError, CapabilityError
from poros.models.skeleton import decoder_layers, layer_linears, skeleton
from poros.settings import Accumulation, Placement, format_size
from poros.store.layout import align, plan_layout

LOAD, RELEASE, FORWARD, HEAD, BACKWARD, LOAD_HEAD, RELEASE_HEAD = (
    "load", "release", "forward", "head", "backward", "load_head", "release_head")
GATHER, GATHER_HEAD = "gather", "gather_head"  # the other ranks' shares of the load before (shard_stream)
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
            parts.append(f"b{self.buffer}")
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
class Geometry:
    """What the planner needs of a model, from its config alone (no weights)."""

    name: str
    layer_starts: tuple[int, ...]  # arena byte offset of each decoder layer
    layer_ends: tuple[int, ...]
    head_bytes: int  # the lm_head weight (bf16)
    hidden: int
    vocab: int
    intermediate: int
    heads: int  # attention heads of the widest layer
    q_width: int  # query elements per token of the widest layer (heads x head_dim)
    max_linear: int  # elements of the largest decoder linear weight
    lora_in_out: tuple[int, ...]  # per LoRA-able linear of every layer: in + out features
    dense_device_bytes: int  # norms, biases and buffers the device holds for every method

    @property
    def n_layers(self) -> int:
        return len(self.layer_starts)

    @classmethod
    def of_config(cls, name: str, config, lora_targets, double_quant: bool = False) -> "Geometry":
        """From `config`'s shapes; `double_quant`: the store's slots are double-quantized (smaller)."""
        from torch import nn


        model = skeleton(config)
        list_name, layers = decoder_layers(model)
        linears = [layer_linears(layer, f"{list_name}.{i}") for i, layer in enumerate(layers)]
        layouts, _ = plan_layout(linears, double_quant)
        head = model.get_output_embeddings().weight
        lora = tuple(a + b for layer in linears for n, (b, a) in layer if n.rsplit(".", 1)[-1] in lora_targets)
        dense = 0
        for mname, m in model.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                if isinstance(m, nn.Linear) and pname == "weight" or isinstance(m, nn.Embedding):
                    continue
                if p is head:
                    continue
                dense += p.numel() * 2
            dense += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False) if b is not None)
        # per layer, from the modules (gemma4's layers differ in head_dim and MLP width)
        attn = [m for m in model.modules() if hasattr(m, "q_proj") and isinstance(getattr(m, "head_dim", None), int)]
        heads = max((m.q_proj.out_features // m.head_dim for m in attn), default=1)
        q_width = max((m.q_proj.out_features for m in attn), default=config.hidden_size)
        mlp = [shape[0] for layer in linears for n, shape in layer if n.endswith(("gate_proj", "up_proj", "fc1"))]
        return cls(
            name=name, layer_starts=tuple(x.start for x in layouts), layer_ends=tuple(x.end for x in layouts),
            head_bytes=head.numel() * 2, hidden=config.hidden_size, vocab=config.vocab_size,
            intermediate=max(mlp, default=4 * config.hidden_size), heads=heads, q_width=q_width,
            max_linear=max(a * b for layer in linears for _, (a, b) in layer),
            lora_in_out=lora, dense_device_bytes=dense)


# --- memory model ------------------------------------------------------------------------------
# Device bytes beyond the weights, per unit, fitted to peaks measured with torch.cuda.max_memory_allocated
# (results/h200-planner): a layer's recompute + backward holds about ACT_HIDDEN bytes per token per hidden
# unit plus ACT_INTERMEDIATE per intermediate unit, and the dequantized bf16 copy of its largest weight;
# the head holds the logits in bf16 and fp32 and their gradient.
ACT_HIDDEN = 24  # bytes per token x hidden of one layer's recompute + backward
ACT_INTERMEDIATE = 14  # bytes per token x intermediate
ATTN_SCORES = 6  # bytes per token^2 x head (math attention keeps the scores and their softmax)
HEAD_LOGITS = 16  # bytes per token x vocab during the head's forward + backward
# Fused attention's backward (flash, memory-efficient) allocates beyond dQ/dK/dV: a float32 dQ accumulator
# (in strict deterministic mode one per split, ceil(FUSED_BWD_SMS / (batch x heads)) splits, so that no two
# blocks add into one), dK and dV for every query head (bf16) before grouped key/value heads sum them, and
# the softmax's row sums (float32 per token x head). It matters at long context only
# (tests/engine/test_plan.py holds it to the peaks in results/h200-reserved-memory).
FUSED_BWD_SMS = 132  # streaming multiprocessors the deterministic split count is planned for (H100, H200)
# The CUDA graphs' private pool holds one layer's recompute and backward intermediates as captured, plus what
# the captures do not share (each graph's own outputs, blocks freed on one capture's stream), in percent of
# one layer's transient bytes: fitted to the pools' reserved bytes in results/h200-reserved-memory, rounded up
# (tests/engine/test_budget.py holds it to them).
GRAPH_POOL_PER_LAYER = 115
# Compiled layers (`compile`) captured in CUDA graphs hold more: at seq 512 on qwen2.5-72b the reserved peak of
# the plan with every resident layer keeping its activations grew 0.55 GB once inductor generated the
# dequantizations (results/h200-40gb-inductor-dequant, against results/h200-compile-40gb-double-quant), and the
# plans with 12 and 16 kept layers no longer fit the pool planned at GRAPH_POOL_PER_LAYER: their pools held
# 1.9 GiB when they refused, 2.2 layers' transient bytes. Rounded up to 250.
GRAPH_POOL_PER_LAYER_COMPILED = 250


# What a CUDA process holds beside its tensors, which a budget (what nvidia-smi shows for the process) counts
# too. CUDA_CONTEXT: the context, the kernel modules loaded as the step first runs them and the library handles
# (cuBLAS with CUBLAS_WORKSPACE_CONFIG :4096:8, cuDNN, flash attention), taken as NVML's peak for the process
# less torch's reserved peak in the H200 rows of results/h200-kept-activations, rounded up to a whole GB; the
# workspaces themselves come from torch's allocator, so the allocator's share below holds them. Where a
# device exists the executor measures the context at run time and plans for the larger of the two.
CUDA_CONTEXT = 10**9
# NCCL_BUFFERS: what a data-parallel rank's NCCL communicator allocates outside torch's allocator (its
# channels' buffers: NCCL_BUFFSIZE, 4 MiB, for each channel, peer and protocol, plus its work queues),
# an estimate from NCCL's default channel count on one host, not a measurement: rows of data-parallel runs
# record the NVML peak beside the reserved one, which checks it.
NCCL_BUFFERS = 5 * 10**8
# ALLOCATOR_SLACK: the caching allocator's reserve beyond what it has handed out (page rounding, blocks
# cached on one stream that another cannot use, holes between live blocks), as a share of the allocator's
# planned bytes. The executor holds the allocator to the budget less the fixed costs (a per-process memory
# fraction, expandable segments), so past that share it releases its cache and maps again instead of
# growing; the slack keeps that rare (results/h200-reserved-memory: reserved against allocated peaks).
ALLOCATOR_SLACK = 0.05
# TRANSIENT_SLACK: beyond that, a share of the transient bytes. One layer's backward frees and asks again for
# intermediates of many sizes (at long context up to about a GB each), so the holes between its live blocks
# grow with them: the share is the smallest that covers the holes of the long-context refusal recorded in
# results/h200-budget-nvml/oom_seq16384.json (tests/engine/test_budget.py holds it to them), and half again.
TRANSIENT_SLACK = 0.12


@dataclass(frozen=True)
class ProcessCosts:
    """What a run's process holds on its device beside the allocator's memory (none on the CPU)."""

    context: int = 0  # CUDA context, kernel modules, library handles
    nccl: int = 0  # NCCL's buffers (data-parallel ranks)
    slack: float = 0.0  # the allocator's reserve, a share of its planned bytes
    transient_slack: float = 0.0  # and a share of the transient bytes (holes among a backward's intermediates)

    @classmethod
    def cuda(cls, ranks: int = 1, measured_context: int | None = None) -> "ProcessCosts":
        """A CUDA process's: the context as measured where that is larger than CUDA_CONTEXT."""
        return cls(context=max(CUDA_CONTEXT, measured_context or 0), nccl=NCCL_BUFFERS if ranks > 1 else 0,
                   slack=ALLOCATOR_SLACK, transient_slack=TRANSIENT_SLACK)


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory as the run found it (poros/engine/nvml.py `device_memory`), bytes."""

    total: int
    free: int  # what no process holds
    process: int = 0  # what this process holds already (NVML; 0 where NVML does not list it)
    context: int | None = None  # of which not torch's allocator's: the context so far (None: not measured)


@dataclass(frozen=True)
class Memory:
    """Predicted peak device memory of the process, by part (bytes): the allocator's tensors (`allocated`,
    what torch.cuda.max_memory_allocated measures), the CUDA graphs' pool and the allocator's reserve
    (with them, what torch.cuda.max_memory_reserved measures), and the fixed costs beside the allocator
    (with all, `total`: what NVML and nvidia-smi show for the process, and what a budget holds)."""

    weight_buffers: int  # streamed groups' buffers (and the lm_head pad)
    resident_weights: int  # resident layers and a resident lm_head
    lora: int  # LoRA parameters, gradients and AdamW state (fp32)
    dense: int  # norms, biases, rotary tables
    saved_inputs: int  # each layer's input, kept for its recompute
    transient: int  # the larger of the head and one (two, overlapped) layers' backward
    templates: int = 0  # CUDA-graph layer templates: LoRA copies of resident layers' own, shared static tensors
    kept_activations: int = 0  # activations resident layers keep from forward to backward (keep_activations)
    # under CUDA graphs the layer templates' intermediates live in the graphs' private pool: reserved, never
    # counted as allocated; at least one layer's recompute and backward
    graph_pool: int = 0
    # the caching allocator's reserve beyond its tensors and pool (ALLOCATOR_SLACK, TRANSIENT_SLACK)
    allocator_reserve: int = 0
    context: int = 0  # CUDA context, kernel modules, library handles (CUDA_CONTEXT or as measured)
    nccl: int = 0  # NCCL's buffers, outside torch's allocator (NCCL_BUFFERS)

    @property
    def allocated(self) -> int:
        """The allocator's peak of live tensors."""
        return (self.weight_buffers + self.resident_weights + self.lora + self.dense + self.saved_inputs
                + self.transient + self.templates + self.kept_activations)

    @property
    def allocator(self) -> int:
        """What torch's allocator may reserve: its tensors, the graphs' pool and its reserve; the executor
        holds it to this (plus what the budget leaves over)."""
        return self.allocated + self.graph_pool + self.allocator_reserve

    @property
    def fixed(self) -> int:
        """The process's device memory outside torch's allocator."""
        return self.context + self.nccl

    @property
    def total(self) -> int:
        """The process's device memory as the driver counts it (nvidia-smi, NVML)."""
        return self.allocator + self.fixed

    def parts(self) -> dict:
        return {"weight_buffers": self.weight_buffers, "resident_weights": self.resident_weights, "lora": self.lora,
                "dense": self.dense, "saved_inputs": self.saved_inputs, "transient": self.transient,
                "templates": self.templates, "kept_activations": self.kept_activations,
                "graph_pool": self.graph_pool, "allocator_reserve": self.allocator_reserve,
                "context": self.context, "nccl": self.nccl}

    def with_costs(self, costs: ProcessCosts) -> "Memory":
        """These tensors and pool in a process with `costs`."""
        reserve = (-(-int(costs.slack * 1000) * (self.allocated + self.graph_pool) // 1000)
                   + -(-int(costs.transient_slack * 1000) * self.transient // 1000))
        return replace(self, allocator_reserve=reserve, context=costs.context, nccl=costs.nccl)


def lora_bytes(geo: Geometry, rank: int) -> int:
    """fp32 LoRA A and B of every target, with gradients and both AdamW moments."""
    return sum(io * rank for io in geo.lora_in_out) * 4 * 4


def template_bytes(geo: Geometry, rank: int) -> int:
    """One layer's own forward and backward templates: three copies of its fp32 LoRA (forward and
    backward parameters, backward gradients). Their activation-sized tensors are shared
    (`template_static_bytes`)."""
    return 3 * sum(io * rank for io in geo.lora_in_out) * 4 // geo.n_layers


def template_static_bytes(geo: Geometry, seq_len: int, batch: int) -> int:
    """The static tensors every template shares (poros/engine/graphs.py `Statics`): the layer input, the incoming
    gradient, the gradient at the input and the output, one activation each."""
    return 4 * seq_len * batch * geo.hidden * 2


def fused_backward_bytes(geo: Geometry, seq_len: int, batch: int, attention: str, deterministic: bool) -> int:
    """What fused attention's backward allocates beyond its gradients (none on the math path)."""
    if attention == "math":
        return 0
    splits = -(-FUSED_BWD_SMS // (batch * geo.heads)) if deterministic else 1
    return seq_len * batch * (geo.q_width * (4 * splits + 2 * 2) + 4 * geo.heads)


def transient_bytes(geo: Geometry, seq_len: int, batch: int, attention: str, overlap: bool,
                    loss_chunk: int = 0, deterministic: bool = False) -> tuple[int, int]:
    """(head, layers): peak bytes the head and the layer backward hold beyond what persists (the head's
    logits `loss_chunk` tokens at a time when it is set)."""
    tokens = seq_len * batch
    layer = (tokens * (ACT_HIDDEN * geo.hidden + ACT_INTERMEDIATE * geo.intermediate) + 2 * geo.max_linear
             + (ATTN_SCORES * batch * geo.heads * seq_len * seq_len if attention == "math" else 0)
             + fused_backward_bytes(geo, seq_len, batch, attention, deterministic))
    head = (min(tokens, loss_chunk * batch) if loss_chunk else tokens) * HEAD_LOGITS * geo.vocab
    return head, layer * (2 if overlap else 1)


# --- plans --------------------------------------------------------------------------------------


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
    # saved layer inputs: kept on the device, or copied to host memory in forward (device->host, the
    # direction the weights leave idle) and back ahead of their backward, `input_window` at a time
    offload_inputs: bool = False
    input_bytes: int = 0  # what one recompute needs saved (one layer, one micro-batch): input, kept attention
    input_window: int = 0
    keep_attention: bool = False  # recomputed layers save their attention's results with their input
    # resident layers that keep their activations from forward to backward: no recompute, resident
    # QLoRA's own forward with autograd and its backward from the kept output
    kept_layers: tuple[int, ...] = ()
    # data-parallel ranks that share every streamed copy (shard_stream): each loads one contiguous share of
    # a group's (or the streamed lm_head's) bytes and a gather brings the others'; 1: each rank copies all
    shards: int = 1

    def shard_size(self, nbytes: int) -> int:
        return shard_size(nbytes, self.shards)

    def shard(self, nbytes: int, rank: int) -> tuple[int, int]:
        """The byte range [lo, hi) of an `nbytes` copy that `rank` loads from host memory (empty past the end)."""
        s = self.shard_size(nbytes)
        return min(rank * s, nbytes), min((rank + 1) * s, nbytes)

    def gathered_size(self, nbytes: int) -> int:
        return gathered_size(nbytes, self.shards)

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
        """Host->device bytes of one step on rank 0 (with shards, the rank whose share is never short)."""
        inputs = self.n_layers * self.grad_accum * self.input_bytes if self.offload_inputs else 0
        return sum(self.op_bytes(op) for op in self.step) + inputs

    @property
    def gathered_bytes_per_step(self) -> int:
        """Bytes of one step each rank receives from the other ranks' shares (0 without shards)."""
        return sum(self.gather_bytes(op) for op in self.step)

    @property
    def d2h_bytes_per_step(self) -> int:
        return self.n_layers * self.grad_accum * self.input_bytes if self.offload_inputs else 0

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
            "shards": self.shards, "gathered_bytes_per_step": self.gathered_bytes_per_step,
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
              head_resident: bool, holds: dict[int, int], shards: int = 1) -> tuple[list[Op], dict[int, int]]:
    """One optimizer step from buffer state `holds` (buffer -> group or HEAD_SLOT); returns the ops and
    the state they leave. A streamed group's load is enqueued when the streamed group before it in the
    pass starts (right after the release of the buffer's previous contents), so the copy runs while the
    compute stream works on that group and on any resident layers between the two. With `shards` ranks each
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
        after = {g.index: nxt for g, nxt in zip(streamed, streamed[1:])}
        for g in seq:
            if not g.resident:
                load(g)  # already there when prefetched, or left by the previous pass
                nxt = after.get(g.index)
                if nxt is not None and nxt.buffer != g.buffer:
                    load(nxt)  # prefetch into the other buffer, released by the streamed group before this one
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
    """What a run asks of the planner, built once from its config (`of_config`). `build_plan` makes the plan
    it describes; `plan_for_budget` searches block size, residency, the lm_head's place and (where
    `offload_inputs` is None) the saved inputs' place for the fastest plan within `budget`."""

    block_size: int
    grad_accum: int = 1
    accumulation: Accumulation = Accumulation.LAYER
    seq_len: int = 512
    batch_size: int = 1
    lora_rank: int = 16
    attention: str = "default"
    overlap_backward: bool = True
    cuda_graphs: bool = False
    offload_inputs: bool | None = None  # None: the planner decides under a budget, else on the device
    loss_chunk: int = 0
    keep_attention: bool = False
    keep_activations: bool = False
    kept_layers: int | None = None
    placement: Placement = Placement.TAIL
    deterministic: bool = False
    compiled: bool = False  # regionally compiled layers (`compile`): their CUDA graphs' pool is planned larger
    resident_layers: int = 0
    head_resident: bool | None = None  # None: resident unless two buffers rotate
    budget: int | None = None  # bytes of the process's device memory; recorded on the plan, fitted by `plan_for_budget`
    process: ProcessCosts = ProcessCosts()  # what the process holds beside the allocator's tensors
    shards: int = 1  # ranks sharing every streamed copy (shard_stream); see Plan.shards

    @classmethod
    def of_config(cls, cfg, device: DeviceMemory | None = None, ranks: int | None = None) -> "PlanRequest":
        """The request `cfg` (a TrainConfig) makes: on a CUDA device for the whole process (its context measured
        in `device` where given, NCCL's buffers for several ranks); `vram_budget: auto` is what `device` has
        free (`auto_budget`); `ranks`, the data-parallel ranks running it (default `cfg.gpus`), share every
        streamed copy under `shard_stream`.

        Raises:
            CapabilityError: `vram_budget: auto` without a device to measure.
        """
        budget = cfg.vram_budget
        if budget == "auto":
            if device is None:
                raise CapabilityError("vram_budget auto needs a CUDA device to measure its free memory; give a size")
            budget = auto_budget(device)
        ranks = ranks or cfg.gpus
        cuda = getattr(cfg.device, "value", cfg.device) == "cuda"
        process = ProcessCosts.cuda(ranks, device.context if device else None) if cuda else ProcessCosts()
        return cls(block_size=cfg.block_size, grad_accum=cfg.grad_accum, accumulation=cfg.accumulation,
                   seq_len=cfg.seq_len, batch_size=cfg.batch_size, lora_rank=cfg.lora_rank,
                   attention=cfg.attention.value, overlap_backward=cfg.overlap_backward, cuda_graphs=cfg.cuda_graphs,
                   offload_inputs=True if cfg.offload_inputs else None, loss_chunk=cfg.loss_chunk or 0,
                   keep_attention=cfg.keep_attention, keep_activations=cfg.keep_activations, kept_layers=cfg.kept_layers, placement=cfg.placement,
                   deterministic=cfg.deterministic, compiled=cfg.compile, budget=budget, process=process,
                   shards=ranks if getattr(cfg, "shard_stream", False) else 1)


AUTO_HEADROOM = 0.02  # share of the device's memory `vram_budget: auto` leaves free (others' growth, the driver's)


def auto_budget(device: DeviceMemory) -> int:
    """`vram_budget: auto`: what the card has free for this process (its free memory and what this process
    holds already), less AUTO_HEADROOM of the card."""
    return max(0, device.free + device.process - int(AUTO_HEADROOM * device.total))


def build_plan(geo: Geometry, request: PlanRequest) -> Plan:
    """The plan keeping `resident_layers` layers (the last ones, or with `placement` spread, all but evenly
    spread streamed ones) and, with `head_resident`, the lm_head on the device for good and streaming the
    rest in groups of `block_size` through two rotating buffers; with `keep_activations` the resident
    layers (at most `kept_layers` of them, spread evenly) keep their activations instead of recomputing them."""
    r = request
    block_size, grad_accum, accumulation, seq_len, batch_size = (r.block_size, r.grad_accum, r.accumulation,
                                                                  r.seq_len, r.batch_size)
    resident_layers, head_resident, attention, offload_inputs = (r.resident_layers, r.head_resident, r.attention,
                                                                 bool(r.offload_inputs))
    graphs = r.cuda_graphs
    n = geo.n_layers
    overlap = r.overlap_backward and not graphs  # layer templates replay one layer's backward at a time
    resident_order = resident_set(n, resident_layers, Placement(r.placement))
    resident = frozenset(resident_order)
    streamed = n - resident_layers
    block = max(1, min(block_size, streamed)) if streamed else block_size
    groups = _groups(geo, resident, block)
    n_groups = sum(not g.resident for g in groups)  # streamed groups
    n_stream = min(2, n_groups)
    groups = _place(groups, n_stream)
    shards = r.shards
    stream_size = align(max((gathered_size(g.nbytes, shards) for g in groups if not g.resident), default=0))
    # the lm_head borrows the idle buffer during the head when two rotate; else it is resident
    if head_resident is None:
        head_resident = n_stream < 2
    head_buffer = None
    if not head_resident and n_stream == 2:
        head_buffer = (n_groups - 2) % 2
    elif not head_resident:
        head_resident = True  # a region of its own would be held all step: keep the lm_head there
    head_pad = align(max(0, gathered_size(geo.head_bytes, shards) - stream_size)) if head_buffer is not None else 0
    buffers = [Buffer(b, stream_size, False) for b in range(n_stream)]
    buffers += [Buffer(g.buffer, align(g.nbytes), True) for g in groups if g.resident]
    # steady state: run one step from empty buffers, then plan every step from where it ends
    _, end = _step_ops(groups, grad_accum, accumulation, head_buffer, head_resident, {}, shards)
    step, after = _step_ops(groups, grad_accum, accumulation, head_buffer, head_resident, end, shards)
    setup = [Op(LOAD, group=g.index, buffer=g.buffer) for g in groups if g.resident]
    for b, grp in sorted(end.items()):
        if grp != HEAD_SLOT and not groups[grp].resident:
            setup.append(Op(LOAD, group=grp, buffer=b))
            if shards > 1:
                setup.append(Op(GATHER, group=grp, buffer=b))
    live = grad_accum if accumulation is Accumulation.LAYER else 1  # micro-batches whose inputs are kept at once
    one_input = seq_len * batch_size * geo.hidden * 2
    one_saved = one_input + (attention_bytes(geo, seq_len, batch_size) if r.keep_attention else 0)
    # offloaded: inputs back on the device ahead of their backward, one block's worth. A copy back starts once
    # the compute stream reaches the backward before (poros/engine/buffers.py `SavedInputs.prefetch`) and
    # has that backward's time: a layer's recompute and backward take more than 2 x 6 x hidden^2 FLOPs a token
    # where its copy moves 2 x hidden bytes (with kept attention about twice that), tens of times shorter on
    # any GPU that streams weights.
    window = block * live
    saved = (window + live) * one_saved if offload_inputs else n * live * one_saved
    head_t, layer_t = transient_bytes(geo, seq_len, batch_size, attention, overlap, r.loss_chunk, r.deterministic)
    kept = kept_set(resident_order, r.kept_layers) if r.keep_activations else ()
    grads_in_flight = (grad_accum if accumulation is Accumulation.LAYER else 1) * seq_len * batch_size * geo.hidden * 2
    memory = Memory(
        weight_buffers=sum(b.nbytes for b in buffers if not b.resident) + head_pad,
        resident_weights=sum(b.nbytes for b in buffers if b.resident) + (geo.head_bytes if head_resident else 0),
        lora=lora_bytes(geo, r.lora_rank), dense=geo.dense_device_bytes, saved_inputs=saved,
        transient=max(head_t, layer_t + grads_in_flight),
        # streamed layers share 2 x block_size templates (their LoRA copies within the measured peaks the
        # model is fitted to); every resident layer has its own weights' addresses, so its own templates
        # a kept layer has a template of its own per micro-batch kept at once, with its own input
        templates=((resident_layers - len(kept)) * template_bytes(geo, r.lora_rank)
                   + len(kept) * live * (template_bytes(geo, r.lora_rank) + one_input)
                   + template_static_bytes(geo, seq_len, batch_size)) if graphs else 0,
        kept_activations=len(kept) * live * layer_activation_bytes(geo, seq_len, batch_size, attention),
        graph_pool=-(-layer_t * (GRAPH_POOL_PER_LAYER_COMPILED if r.compiled else GRAPH_POOL_PER_LAYER) // 100)
        if graphs else 0).with_costs(r.process)
    plan = Plan(geo.name, n, block, grad_accum, accumulation, tuple(groups), tuple(buffers), head_resident, head_buffer,
                head_pad, geo.head_bytes, tuple(setup), tuple(step), memory, r.budget, offload_inputs,
                one_saved, window, r.keep_attention, kept, shards=shards)
    problems = check(plan)
    if problems or after != end:
        raise AssertionError(f"planner produced an invalid plan: {problems or 'not a steady state'}")
    return plan


LSE_ROWS = 32  # memory-efficient attention pads its log-sum-exp's rows to a multiple of this


def attention_bytes(geo: Geometry, seq_len: int, batch: int) -> int:
    """What `keep_attention` saves per layer and micro-batch: the widest layer's attention output (bf16) and its
    log-sum-exp (fp32, per head and query row)."""
    rows = -(-seq_len // LSE_ROWS) * LSE_ROWS
    return seq_len * batch * geo.q_width * 2 + batch * geo.heads * rows * 4


def layer_activation_bytes(geo: Geometry, seq_len: int, batch: int, attention: str) -> int:
    """What one layer's forward with autograd keeps for its backward, one micro-batch."""
    return seq_len * batch * (ACT_HIDDEN * geo.hidden + ACT_INTERMEDIATE * geo.intermediate) + (
        ATTN_SCORES * batch * geo.heads * seq_len * seq_len if attention == "math" else 0)


def resident_memory(geo: Geometry, request: PlanRequest) -> int:
    """Predicted peak of resident QLoRA (every weight on the device, every activation kept)."""
    r = request
    head_t, _ = transient_bytes(geo, r.seq_len, r.batch_size, r.attention, overlap=False,
                                deterministic=r.deterministic)
    per_layer = layer_activation_bytes(geo, r.seq_len, r.batch_size, r.attention)
    return (geo.layer_ends[-1] + 2 * geo.head_bytes + lora_bytes(geo, r.lora_rank) + geo.dense_device_bytes
            + geo.n_layers * per_layer + max(head_t, 2 * geo.max_linear))


def make_plan(geo: Geometry, cfg, device: DeviceMemory | None = None, ranks: int | None = None) -> Plan:
    """The plan a TrainConfig `cfg` asks for: every layer streamed, or the fastest whose process fits
    `cfg.vram_budget` (`device`: the CUDA device as the run found it, for its context and `vram_budget: auto`;
    `ranks`: the data-parallel ranks that run it, default `cfg.gpus`)."""
    request = PlanRequest.of_config(cfg, device, ranks)
    return build_plan(geo, request) if request.budget is None else plan_for_budget(geo, request)


def plan_for_budget(geo: Geometry, request: PlanRequest) -> Plan:
    """The plan that copies the fewest bytes per step and whose process's predicted peak (`Memory.total`: the
    allocator's tensors, the CUDA graphs' pool, the allocator's reserve and the fixed costs) fits
    `request.budget`: the
    lm_head resident first (it saves its own copy and a reload), then as many layers as fit (placed as
    `placement` says: from the last one down, or spread), with the largest block size up to `block_size`
    that fits; saved inputs where `offload_inputs` says, or (None) wherever copies fewer bytes.

    Raises:
        BudgetError: no plan fits; names the smallest budget that would.
    """

    best, smallest = None, None
    budget, given = request.budget, request.offload_inputs
    choices = [(b, h, o) for b in range(request.block_size, 0, -1) for h in (True, False)
               for o in ((False, True) if given is None else (given,))]
    for block, head, offload in choices:
        lo, hi, fit = 0, geo.n_layers, None
        while lo <= hi:  # most resident layers that fit (memory grows with them)
            r = (lo + hi) // 2
            p = build_plan(geo, replace(request, block_size=block, resident_layers=r, head_resident=head,
                                        offload_inputs=offload))
            if smallest is None or p.memory.total < smallest.memory.total:
                smallest = p
            if p.memory.total <= budget:
                fit, lo = p, r + 1
            else:
                hi = r - 1
        if fit is not None and (best is None or fit.h2d_bytes_per_step < best.h2d_bytes_per_step):
            best = fit
    if best is None:
        m = smallest.memory
        beside = [f"{gb(v)} {name}" for name, v in (("CUDA-graph pool", m.graph_pool), ("allocator reserve",
                  m.allocator_reserve), ("CUDA context", m.context), ("NCCL buffers", m.nccl)) if v]
        graphs = " or drop --cuda-graphs" if m.graph_pool else ""
        raise BudgetError(f"vram_budget {format_size(budget)} is below the smallest plan for {geo.name} "
                          f"({gb(m.total)} for the process: {gb(m.allocated)} of tensors with block size {smallest.block_size}, "
                          f"every layer streamed, saved inputs in host memory" + "".join(f", {b}" for b in beside)
                          + f"); use --vram-budget {_size_at_least(m.total)} or more, or a shorter --seq-len{graphs}")
    return best


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _size_at_least(n: int) -> str:
    """`n` bytes rounded up to a tenth of its unit, as --vram-budget takes it."""
    unit, name = (10**9, "GB") if n >= 10**9 else (10**6, "MB") if n >= 10**6 else (10**3, "kB")
    return f"{-(-n * 10 // unit) / 10:g}{name}"


# --- rules ---------------------------------------------------------------------------------------


def check(plan: Plan) -> list[str]:
    """Every rule the plan breaks (empty when it is safe to run); see the module docstring."""
    problems: list[str] = []
    holds: dict[int, int] = {}  # buffer -> group (or HEAD_SLOT)
    released: dict[int, bool] = {}  # buffer -> released since its last read
    ungathered: set[int] = set()  # buffers holding this rank's share of a load, the others' not gathered yet

    def shared(op: Op) -> bool:
        return plan.shards > 1 and (op.kind == LOAD_HEAD or not plan.groups[op.group].resident)

    def gather(where: str, op: Op) -> None:
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
            gather(f"setup op {pos} ({op})", op)
            continue
        holds[op.buffer] = op.group
        released[op.buffer] = True
        (ungathered.add if shared(op) else ungathered.discard)(op.buffer)
    seen_fwd, seen_bwd, seen_head = set(), set(), set()
    last_bwd: dict[int, int] = {}
    group_of = plan.group_of

    for pos, op in enumerate(plan.step):
        where = f"op {pos} ({op})"
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
        elif op.kind in (FORWARD, BACKWARD):
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
        else:
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
    return problems


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


def describe(plan: Plan) -> str:
    """`poros plan`'s text: residency, bytes per step and the process's predicted peak by part."""
    res, st = plan.resident_layers, plan.streamed_layers
    span = lambda xs: "none" if not xs else f"{_ranges(xs)} ({len(xs)})"  # noqa: E731
    lines = [
        f"plan for {plan.model}: {plan.n_layers} layers, block size {plan.block_size}, grad_accum {plan.grad_accum}"
        + (f" ({plan.accumulation.value}-major)" if plan.grad_accum > 1 else ""),
        f"  streamed layers:  {span(st)}",
        f"  resident layers:  {span(res)}" + (
            "" if not plan.kept_layers else " (activations kept: no recompute)" if len(plan.kept_layers) == len(res)
            else f" (activations kept, no recompute: {span(list(plan.kept_layers))})"),
        f"  lm_head:          {'resident' if plan.head_resident else f'streamed into buffer {plan.head_buffer}'}",
        f"  host->device per optimizer step: {gb(plan.h2d_bytes_per_step)} ({plan.loads_per_step} group loads"
        + (f", saved inputs back: {gb(plan.d2h_bytes_per_step)})" if plan.offload_inputs else ")"),
        *([f"  shared stream over {plan.shards} ranks: each rank copies its 1/{plan.shards} of every streamed "
           f"block from host memory (above: rank 0's) and all-gathers {gb(plan.gathered_bytes_per_step)} per "
           "optimizer step from the others, in place into the stream buffers"] if plan.shards > 1 else []),
        f"  saved layer inputs{' and attention results' if plan.keep_attention else ''}: "
        f"{'host memory (device->host in forward)' if plan.offload_inputs else 'device'}",
    ]
    m = plan.memory
    parts = m.parts()
    lines.append(f"  predicted peak device memory of the process: {gb(m.total)}"
                 + (f" (budget {format_size(plan.budget)})" if plan.budget else ""))
    lines.append(f"    {'tensors':21s} {gb(m.allocated)} (allocated)")
    lines += [f"      {k:19s} {gb(v)}" for k, v in parts.items() if k not in BESIDE_TENSORS]
    lines += [f"    {k:21s} {gb(parts[k])} ({what})" for k, what in BESIDE_TENSORS.items() if parts[k]]
    return "\n".join(lines)
