"""The memory model: a plan's predicted peak device memory by part, for the allocator's tensors, the CUDA
graphs' pool, the allocator's reserve and what the process holds beside them (context, NCCL's buffers).
A budget holds the total, what NVML and nvidia-smi show for the process."""

from __future__ import annotations

from dataclasses import dataclass, replace

from poros.choices import Attention
from poros.config import TrainConfig
from poros.engine.planning.geometry import Geometry

# Device bytes beyond the weights, per unit, fitted to peaks measured with torch.cuda.max_memory_allocated
# (results/h200-plans): a layer's recompute + backward holds about ACT_HIDDEN bytes per token per hidden
# unit plus ACT_INTERMEDIATE per intermediate unit, and the dequantized bf16 copy of its largest weight;
# the head holds the logits in bf16 and fp32 and their gradient.
ACT_HIDDEN = 24  # bytes per token x hidden of one layer's recompute + backward
ACT_INTERMEDIATE = 14  # bytes per token x intermediate
# `attention_chunk` (poros/engine/model/attention_chunk.py) runs a layer's norms and attention projections a chunk at a
# time, so what they save for the backward is one chunk's, not the sequence's. Measured on the CPU
# (tests/engine/test_attention_chunk.py: bytes a tiny layer's forward saves, with and without the chunk), what
# leaves per token per hidden unit is the two norms' float32 copies of their inputs (4 bytes each) less the
# bf16 input the post-attention norm's checkpoint now keeps (2 bytes): 6. The LoRA layers' rank-wide products
# leave too (negligible at rank 16 against hidden 8192), and with `lora_compute: fp32` their float32 copies of
# the projections' inputs (16 bytes more), which this does not count: the term is the least the chunk removes.
# The peak live during the CPU backward falls by more (the norms' float32 gradients are one chunk's too); GPU
# peaks must confirm the term before it is raised.
ACT_ATTENTION_CHUNKED = 6  # bytes per token x hidden that attention_chunk takes out of a layer's saved tensors
ATTN_SCORES = 6  # bytes per token^2 x head (math attention keeps the scores and their softmax)
HEAD_LOGITS = 16  # bytes per token x vocab during the head's forward + backward
# Compiled layers (`compile`) hold less in a layer's recompute + backward than the formula above, which was fitted
# to eager peaks: qwen2.5-72b at 32,768 tokens with `mlp_chunk` and `loss_chunk` 2048, fast attention under strict
# determinism, held 11.77 GB beyond what persists on a 4-layer cut of the model on an H200, 93.3% of the 12.61 GB
# planned (experiments/h200-memory-probe), and the full model's allocated peak on an H100 fell 0.84 GB short of
# the plan's tensors (experiments/h100-long-context-32k), the same bytes. In percent of the formula, rounded up.
# It under-counts them at 65,536 tokens: the same cut's layers held 106% of the formula there, more than twice their
# 32,768-token bytes (experiments/h200-compile-mlp-probe); a plan that long runs its MLP eager (`compile_mlp` off).
LAYER_TRANSIENT_COMPILED = 94
# Compiled layers whose MLP runs eager between their compiled parts (`compile_mlp` off) hold less again: on the same
# 4-layer cut at 32,768 tokens a layer's recompute + backward held 80.4% of the formula (the incoming gradient
# included) with `attention_chunk` 2048 and 80.6% without (experiments/h200-compile-mlp-probe), where the layers
# compiled whole held 106% and 93% of it. In percent, rounded up; the full model's 65,536-token plan within 40 GB
# then comes within 2% of its NVML peak (experiments/h200-long-context-64k-eager-mlp).
LAYER_TRANSIENT_EAGER_MLP = 81
# Fused attention's backward (flash, memory-efficient) allocates beyond dQ/dK/dV: a float32 dQ accumulator
# (in strict deterministic mode one per split, ceil(FUSED_BWD_SMS / (batch x heads)) splits, so that no two
# blocks add into one), dK and dV for every query head (bf16) before grouped key/value heads sum them, and
# the softmax's row sums (float32 per token x head). It matters at long context only
# (tests/engine/test_plan.py holds it to the peaks in experiments/h200-reserved-memory).
FUSED_BWD_SMS = 132  # streaming multiprocessors the deterministic split count is planned for (H100, H200)
# FlashAttention-4's backward (`attention: fa4`, flash_attn/cute/interface.py `_flash_attn_bwd`) allocates one
# float32 dQ accumulator whether deterministic or not (its deterministic mode orders the adds with semaphores
# instead of splitting), float32 dK and dV accumulators where query heads share key/value heads, and two float32
# rows per token and head (dPsum, the log-sum-exp in base 2).
# The CUDA graphs' private pool holds one layer's recompute and backward intermediates as captured, plus what
# the captures do not share (each graph's own outputs, blocks freed on one capture's stream), in percent of
# one layer's transient bytes: fitted to the pools' reserved bytes in experiments/h200-reserved-memory, rounded up
# (tests/engine/test_budget.py holds it to them).
GRAPH_POOL_PER_LAYER = 115
# Compiled layers (`compile`) captured in CUDA graphs hold more: at seq 512 on qwen2.5-72b the reserved peak of
# the plan with every resident layer keeping its activations grew 0.55 GB once inductor generated the
# dequantizations (results/h200-compile/40gb-inductor-dequant, against experiments/h200-compile-40gb-double-quant), and the
# plans with 12 and 16 kept layers no longer fit the pool planned at GRAPH_POOL_PER_LAYER: their pools held
# 1.9 GiB when they refused, 2.2 layers' transient bytes. Rounded up to 250.
GRAPH_POOL_PER_LAYER_COMPILED = 250
# Without kept activations compiled layers' pools hold less. At seq 512 on an H100, each plan alone in its process
# (experiments/h100-memory-pools), the graphs' private pools reserved 130% (qwen3-32b, every layer streamed), 141%
# (qwen3-32b within 12 GB), 130% (gemma3-27b streamed) and 144% (qwen2.5-72b streamed) of a layer's transient bytes.
# Rounded up to 150.
GRAPH_POOL_PER_LAYER_COMPILED_UNKEPT = 150


# What a CUDA process holds beside its tensors, which a budget (what nvidia-smi shows for the process) counts
# too. CUDA_CONTEXT: the context, the kernel modules loaded as the step first runs them and the library handles
# (cuBLAS with CUBLAS_WORKSPACE_CONFIG :4096:8, cuDNN, flash attention), taken as NVML's peak for the process
# less torch's reserved peak: 0.78-0.83 GB in every H200 and H100 row that records both (results/, experiments/,
# compiled or eager, 512 to 32,768 tokens), rounded up to 0.9 GB; the workspaces themselves come from torch's
# allocator, so the allocator's share below holds them. Where a device exists the executor measures the context
# at run time and plans for the larger of the two.
CUDA_CONTEXT = 9 * 10**8
# NCCL_BUFFERS: what a data-parallel rank's NCCL communicator allocates outside torch's allocator (its
# channels' buffers: NCCL_BUFFSIZE, 4 MiB, for each channel, peer and protocol, plus its work queues),
# an estimate from NCCL's default channel count on one host, not a measurement: rows of data-parallel runs
# record the NVML peak beside the reserved one, which checks it.
NCCL_BUFFERS = 5 * 10**8
# ALLOCATOR_SLACK: the caching allocator's reserve beyond what it has handed out (page rounding, blocks
# cached on one stream that another cannot use, holes between live blocks), as a share of the allocator's
# planned bytes. The executor holds the allocator to the budget less the fixed costs (a per-process memory
# fraction, expandable segments), so past that share it releases its cache and maps again instead of
# growing; the slack keeps that rare (experiments/h200-reserved-memory: reserved against allocated peaks).
ALLOCATOR_SLACK = 0.05
# TRANSIENT_SLACK: beyond that, a share of the transient bytes. One layer's backward frees and asks again for
# intermediates of many sizes (at long context up to about a GB each), so the holes between its live blocks
# grow with them: the share is the smallest that covers the holes of the long-context refusal recorded in
# experiments/h200-budget-nvml/oom_seq16384.json (tests/engine/test_budget.py holds it to them), and half again.
TRANSIENT_SLACK = 0.12


@dataclass(frozen=True)
class ProcessCosts:
    """What a run's process holds on its device beside the allocator's memory (none on the CPU)."""

    context: int = 0  # CUDA context, kernel modules, library handles
    nccl: int = 0  # NCCL's buffers (data-parallel ranks)
    slack: float = 0.0  # the allocator's reserve, a share of its planned bytes
    transient_slack: float = 0.0  # and a share of the transient bytes (holes among a backward's intermediates)
    held: int = 0  # tensors torch's allocator holds for this process before the run (`DeviceMemory.allocated`)

    @classmethod
    def cuda(cls, ranks: int = 1, measured_context: int | None = None, held: int = 0) -> "ProcessCosts":
        """A CUDA process's: the context as measured where that is larger than CUDA_CONTEXT; `held`, the tensors
        the process holds already."""
        return cls(context=max(CUDA_CONTEXT, measured_context or 0), nccl=NCCL_BUFFERS if ranks > 1 else 0,
                   slack=ALLOCATOR_SLACK, transient_slack=TRANSIENT_SLACK, held=held)


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory as the run found it (poros/engine/runtime/nvml.py `device_memory`), bytes."""

    total: int
    free: int  # what no process holds
    process: int = 0  # what this process holds already (NVML; 0 where NVML does not list it)
    context: int | None = None  # of which not torch's allocator's: the context so far (None: not measured)
    # the live tensors torch's allocator holds for this process already (earlier work in it: a matrix's earlier
    # cells, a caller's own tensors, cuBLAS's workspaces), which the allocator's cap and the budget count too
    allocated: int = 0


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
    held: int = 0  # tensors the process held before the run (ProcessCosts.held): live beside the plan's own

    @property
    def planned(self) -> int:
        """The peak of the plan's own live tensors."""
        return (self.weight_buffers + self.resident_weights + self.lora + self.dense + self.saved_inputs
                + self.transient + self.templates + self.kept_activations)

    @property
    def allocated(self) -> int:
        """The allocator's peak of live tensors: the plan's and what the process held before it."""
        return self.planned + self.held

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
                "context": self.context, "nccl": self.nccl, **({"held": self.held} if self.held else {})}

    def with_costs(self, costs: ProcessCosts) -> "Memory":
        """These tensors and pool in a process with `costs`. The reserve is a share of the plan's own bytes:
        what the process held before is already laid out in the allocator's blocks."""
        reserve = (-(-int(costs.slack * 1000) * (self.planned + self.graph_pool) // 1000)
                   + -(-int(costs.transient_slack * 1000) * self.transient // 1000))
        return replace(self, allocator_reserve=reserve, context=costs.context, nccl=costs.nccl, held=costs.held)


def lora_bytes(geo: Geometry, rank: int) -> int:
    """fp32 LoRA A and B of every target, with gradients and both AdamW moments."""
    return sum(io * rank for io in geo.lora_in_out) * 4 * 4


def template_bytes(geo: Geometry, rank: int) -> int:
    """One layer's own forward and backward templates: three copies of its fp32 LoRA (forward and
    backward parameters, backward gradients). Their activation-sized tensors are shared
    (`template_static_bytes`)."""
    return 3 * sum(io * rank for io in geo.lora_in_out) * 4 // geo.n_layers


def template_static_bytes(geo: Geometry, seq_len: int, batch: int) -> int:
    """The static tensors every template shares (poros/engine/runtime/graphs.py `Statics`): the layer input, the
    incoming gradient, the gradient at the input and the output, one activation each."""
    return 4 * seq_len * batch * geo.hidden * 2


def fused_backward_bytes(geo: Geometry, seq_len: int, batch: int, attention: Attention, deterministic: bool) -> int:
    """What fused attention's backward allocates beyond its gradients (none on the math path)."""
    if attention is Attention.MATH:
        return 0
    if attention is Attention.FA4:
        kv_width = geo.kv_width or geo.q_width
        grouped = 2 * kv_width * 4 if kv_width < geo.q_width else 0
        own = seq_len * batch * (geo.q_width * 4 + grouped + 2 * 4 * geo.heads)
        # a model some of whose calls FA4 leaves to `fast` (masked, wide heads) may hold either backward's
        return max(own, fused_backward_bytes(geo, seq_len, batch, Attention.FAST, deterministic)) \
            if geo.other_attention else own
    splits = -(-FUSED_BWD_SMS // (batch * geo.heads)) if deterministic else 1
    return seq_len * batch * (geo.q_width * (4 * splits + 2 * 2) + 4 * geo.heads)


def graph_pool_bytes(layer_transient: int, compiled: bool, *, kept: bool) -> int:
    """The CUDA graphs' private pool of a plan whose layer backward holds `layer_transient` bytes; `kept`: some of
    its layers keep their activations from forward to backward."""
    if not compiled:
        share = GRAPH_POOL_PER_LAYER
    else:
        share = GRAPH_POOL_PER_LAYER_COMPILED if kept else GRAPH_POOL_PER_LAYER_COMPILED_UNKEPT
    return -(-layer_transient * share // 100)


def counted_attention(attention: Attention, compiled: bool) -> Attention:
    """The attention whose backward a plan's layer transient counts: `attention`, but the fast path's for compiled
    layers on FlashAttention-4. FA4's backward allocates less than the fast path's deterministic one (one dQ
    accumulator, not one per split), yet qwen2.5-72b cut to four layers, compiled whole, at 32,768 tokens held the
    same bytes beyond what persists on either: 11.78 GB on FA4 (experiments/h100-long-context-fa4-32k/memory-probe)
    and 11.77 on the fast path (experiments/h200-memory-probe), to which LAYER_TRANSIENT_COMPILED is fitted; the
    compiled layer's peak lies where neither workspace is live. Layers compiled with their MLP eager count it the
    same way (unmeasured on FA4: the larger of the two)."""
    return Attention.FAST if compiled and attention is Attention.FA4 else attention


def compiled_transient(layer: int, compiled: bool, compile_mlp: bool = True) -> int:
    """A layer's recompute + backward bytes (`transient_bytes`'s second) as compiled layers hold them, whole or
    with their MLP eager (`compile_mlp` off)."""
    if not compiled:
        return layer
    return -(-layer * (LAYER_TRANSIENT_COMPILED if compile_mlp else LAYER_TRANSIENT_EAGER_MLP) // 100)


def counted_attention_chunk(compiled: bool, compile_mlp: bool, attention_chunk: int | None) -> int | None:
    """The `attention_chunk` whose saving a plan counts: none for layers compiled whole, whose recompute + backward
    held the same bytes with and without it (experiments/h200-compile-mlp-probe: 11.75 GB at 32,768 tokens either
    way); with their MLP eager they hold one chunk's as the formula says."""
    return None if compiled and compile_mlp else attention_chunk


def mlp_intermediate_bytes(geo: Geometry, tokens: int, batch: int, mlp_chunk: int | None = None) -> int:
    """The MLP intermediates alive at once in a layer's recompute + backward: `tokens`' (one micro-batch's), or
    with `mlp_chunk` one chunk's (`mlp_chunk` tokens of each of the `batch` sequences:
    poros/engine/model/mlp_chunk.py)."""
    return (min(tokens, mlp_chunk * batch) if mlp_chunk else tokens) * ACT_INTERMEDIATE * geo.intermediate


def attention_chunk_saving(geo: Geometry, tokens: int, batch: int, attention_chunk: int | None) -> int:
    """Bytes `attention_chunk` takes out of what a layer's forward saves for its backward (`tokens` of one
    micro-batch; one chunk's, `attention_chunk` tokens of each of the `batch` sequences, are still saved while
    that chunk is recomputed): ACT_ATTENTION_CHUNKED per hidden unit."""
    if not attention_chunk:
        return 0
    return (tokens - min(tokens, attention_chunk * batch)) * ACT_ATTENTION_CHUNKED * geo.hidden


def transient_bytes(geo: Geometry, seq_len: int, batch: int, attention: Attention, overlap: bool,
                    loss_chunk: int | None = None, deterministic: bool = False,
                    mlp_chunk: int | None = None, attention_chunk: int | None = None) -> tuple[int, int]:
    """(head, layers): peak bytes the head and the layer backward hold beyond what persists (the head's
    logits `loss_chunk` tokens at a time when it is set, the MLP's intermediates `mlp_chunk` tokens at a time, the
    norms' and attention projections' saved tensors `attention_chunk` tokens at a time)."""
    tokens = seq_len * batch
    layer = (tokens * ACT_HIDDEN * geo.hidden - attention_chunk_saving(geo, tokens, batch, attention_chunk)
             + mlp_intermediate_bytes(geo, tokens, batch, mlp_chunk)
             + 2 * geo.max_linear
             + (ATTN_SCORES * batch * geo.heads * seq_len * seq_len if attention is Attention.MATH else 0)
             + fused_backward_bytes(geo, seq_len, batch, attention, deterministic))
    head = (min(tokens, loss_chunk * batch) if loss_chunk else tokens) * HEAD_LOGITS * geo.vocab
    return head, layer * (2 if overlap else 1)


LSE_ROWS = 32  # memory-efficient attention pads its log-sum-exp's rows to a multiple of this


def attention_parts(geo: Geometry, seq_len: int, batch: int) -> tuple[int, int]:
    """What `keep_attention` saves per layer and micro-batch, tensor by tensor: the widest layer's attention
    output (bf16) and its log-sum-exp (fp32, per head and query row)."""
    rows = -(-seq_len // LSE_ROWS) * LSE_ROWS
    return seq_len * batch * geo.q_width * 2, batch * geo.heads * rows * 4


def attention_bytes(geo: Geometry, seq_len: int, batch: int) -> int:
    """The bytes of `attention_parts` together."""
    return sum(attention_parts(geo, seq_len, batch))


def layer_activation_bytes(geo: Geometry, seq_len: int, batch: int, attention: Attention,
                           mlp_chunk: int | None = None, attention_chunk: int | None = None) -> int:
    """What one layer's forward with autograd keeps for its backward, one micro-batch. A chunked MLP
    (`mlp_chunk`) keeps none of its intermediates (its checkpointed chunks keep their inputs, views of the
    MLP's input): the backward recomputes one chunk's at a time, which `transient_bytes` counts; so do the
    chunked norms and attention projections (`attention_chunk`) of theirs."""
    tokens = seq_len * batch
    return (tokens * ACT_HIDDEN * geo.hidden - attention_chunk_saving(geo, tokens, batch, attention_chunk)
            + (0 if mlp_chunk else mlp_intermediate_bytes(geo, tokens, batch))) + (
        ATTN_SCORES * batch * geo.heads * seq_len * seq_len if attention is Attention.MATH else 0)


def resident_memory(geo: Geometry, cfg: TrainConfig) -> int:
    """Predicted peak of resident QLoRA on `cfg`'s settings (every weight on the device, every activation kept;
    the head's logits, a chunked MLP's intermediates and the chunked attention projections' and norms' saved
    tensors one chunk at a time where `cfg` chunks them)."""
    head_t, _ = transient_bytes(geo, cfg.seq_len, cfg.batch_size, cfg.attention, overlap=False,
                                loss_chunk=cfg.loss_chunk, deterministic=cfg.deterministic)
    per_layer = layer_activation_bytes(geo, cfg.seq_len, cfg.batch_size, cfg.attention, cfg.mlp_chunk,
                                       cfg.attention_chunk)
    # a layer's backward: its dequantized weight, and with a chunked MLP the chunk it recomputes
    backward = 2 * geo.max_linear + (mlp_intermediate_bytes(geo, cfg.seq_len * cfg.batch_size, cfg.batch_size,
                                                            cfg.mlp_chunk) if cfg.mlp_chunk else 0)
    return (geo.layer_ends[-1] + 2 * geo.head_bytes + lora_bytes(geo, cfg.lora_rank) + geo.dense_device_bytes
            + geo.n_layers * per_layer + max(head_t, backward))


AUTO_HEADROOM = 0.02  # share of the device's memory `vram_budget: auto` leaves free (others' growth, the driver's)


def auto_budget(device: DeviceMemory) -> int:
    """`vram_budget: auto`: what the card has free for this process (its free memory and what this process
    holds already), less AUTO_HEADROOM of the card."""
    return max(0, device.free + device.process - int(AUTO_HEADROOM * device.total))


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"
