"""The executor: runs a plan (poros/engine/planning/plan.py) on the device, bitwise equal to resident QLoRA.

The very same modules and kernels run as in resident training; only where the NF4 bytes sit and when
they are copied differ. Per micro-batch, a *prologue* runs the Hugging Face forward with every
decoder layer replaced by a recorder: it computes what the model computes before its layers
(embeddings, rotary tables, masks) and records each layer's call arguments, then stops. The plan's
operations then run the layers themselves:

  load, release       a group's NF4 bytes into its buffer, and the point after which the buffer may be
                      refilled (poros/engine/buffers.py: the copies and the events that order them);
  gather              with copies shared among data-parallel ranks (shard_stream), the other ranks'
                      shares of the load before, all-gathered into the buffer;
  offload, fetch      a saved input the plan keeps in host memory, out after its forward and back ahead of its
                      backward (poros/engine/saved_inputs.py);
  regenerate          with `input_stride`, a layer's no-grad forward again in backward, from its input: the
                      input of the layer above, which saved none (poros/engine/planning/regen.py);
  forward, backward   a layer, by the runner of its kind (poros/engine/runners.py: recomputed or kept,
                      eagerly or through layer templates replayed from CUDA graphs);
  head                the Hugging Face forward again, each layer handing on its input and the last one
                      a leaf holding the last hidden state, so the final norm, lm_head and loss run
                      exactly as in the model, with autograd, and backpropagate to the leaf.

A backward is pending until the next one needs its gradient: with `overlap_backward` a worker thread
enqueues it while this thread enqueues the next layer's recompute (the same kernels on the same stream;
the host-side launch work overlaps).
"""

from __future__ import annotations

import contextlib
import enum
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from poros.config import Method
from poros.engine.planning import plan as P
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.rules import check
from poros.engine.allocator_limit import AllocatorLimit
from poros.engine.attention import sdpa_context
from poros.engine.buffers import HEAD_KEY, DeviceBuffers
from poros.engine.distributed import SINGLE, GradReducer, World, gather_group, release_group, same_on_every_rank
from poros.engine.templates import LayerTemplates
from poros.engine import kept_attention
from poros.engine.layer_call import LayerCall
from poros.engine.nvml import device_memory
from poros.engine.planning.budget import make_plan
from poros.engine.qlora import QLoRAModel
from poros.engine.runners import Done, Kept, Key, Recompute, Runner, TemplateKept, TemplateRecompute
from poros.engine.saved_inputs import SavedInputs, host_memory
from poros.engine.compiling import backward_keeps_saved_tensors, compile_layers
from poros.engine.trainer import Trainer
from poros.errors import BudgetError, CapabilityError
from poros.settings import format_size
from poros.store.arena import slot_tensors


class _Captured(Exception):
    """Ends a prologue once the last layer's arguments are recorded."""


class _Pass(enum.Enum):
    """What the patched layers and embedding do during a run of the Hugging Face forward."""

    PLAIN = "plain"  # the model's own forward
    PROLOGUE = "prologue"  # layers record their call arguments; the last one ends the run
    HEAD = "head"  # layers hand on their input, the last one the leaf holding the last hidden state


@dataclass
class _Step:
    """The state of one optimizer step's operations, dropped when the step ends."""

    batches: list
    losses: list
    micro: int = 0  # the micro-batch the prologue records
    calls: dict[Key, LayerCall] = field(default_factory=dict)  # recorded by the prologue, taken by the forward
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # micro-batch -> hidden state between layers
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # micro-batch -> gradient at a layer's output
    leaf: torch.Tensor | None = None  # the head's last hidden state
    pending: tuple | None = None  # (pending gradient, micro-batch, layer, backward count) in flight
    backwards: int = 0


def geometry_of_store(store, cfg) -> Geometry:
    """The planner's view of a built store (the same numbers `Geometry.of_config` derives from shapes)."""
    return Geometry.of_config(cfg.model, store.config, cfg.lora_targets, store.double_quant)


class PorosTrainer(Trainer):
    """QLoRA whose decoder weights reach the device as `plan` says; arithmetic identical to resident.

    Args:
        plan: run this plan instead of the one `cfg` asks for (it is checked unless `check_plan` is False,
            which only negative controls use).
    """

    method = Method.POROS.value

    def __init__(self, store, cfg, world: World = SINGLE, *, plan: P.Plan | None = None, check_plan: bool = True):
        self._given_plan, self._check_plan = plan, check_plan
        # process-wide settings held while this trainer lives: keep_attention's kernels, compiled backwards that
        # keep their saved tensors for kept layers' templates
        self._held = contextlib.ExitStack()
        self._pass, self._step, self._gathers = _Pass.PLAIN, None, None
        self._regenerations = 0  # regenerate operations run this step (input_stride)
        super().__init__(store, cfg, world)

    def _distribute(self) -> None:
        """Each layer's LoRA gradients all-reduced once the backward of its last micro-batch is enqueued."""
        self.reducer = GradReducer([[p for p in layer.parameters() if p.requires_grad] for layer in self.qlora.layers],
                                   self.world)

    # --- set-up -------------------------------------------------------------------------------
    def _make_model(self) -> QLoRAModel:
        self._refuse_shared_kv()
        self.plan = self._given_plan or self._plan_for_device()
        if self._check_plan:
            self._refuse_unsafe(self.plan)
        self.allocator_limit = AllocatorLimit(self.plan, self.device)  # before the first device allocation
        try:
            return self._make_within_limit()
        except BaseException:  # a trainer never built is never closed: the cap goes now
            self.allocator_limit.release()
            self._held.close()
            raise

    def _make_within_limit(self) -> QLoRAModel:
        if self.cfg.keep_attention:
            self._held.enter_context(kept_attention.installed())
        if self.cfg.compile and self.plan.kept_layers:
            self._held.enter_context(backward_keeps_saved_tensors())
        model = self._host_model()
        self._shared_stream()
        self.buffers = DeviceBuffers(self.plan, self.store, self.device, model.hf.get_output_embeddings().weight,
                                     self.world if self.plan.shards > 1 else SINGLE, self._gathers)
        self._bind_weights(model)
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="poros-backward")
                        if self.cfg.overlap_backward and not self.cfg.cuda_graphs else None)
        self.templates = LayerTemplates(capture=True, compiled=self.cfg.compile) if self.cfg.cuda_graphs else None
        self.saved = SavedInputs(self.plan, self.device, pin=self.cfg.pin_memory)
        self.runners = self._runners(model.layers)
        if self.cfg.compile:
            compile_layers(model.layers)
        self._backward_keys = [(op.layer, op.micro) for op in self.plan.step if op.kind == P.BACKWARD]
        last = {layer: k for k, (layer, _) in enumerate(self._backward_keys)}
        self._layer_final = {k + 1 for k in last.values()}  # backward counts after which a layer's gradients are whole
        self._patch(model)
        self._load_setup()
        return model

    def _refuse_shared_kv(self) -> None:
        config = self.store.config
        if getattr(config, "num_kv_shared_layers", 0):
            raise CapabilityError(f"{self.cfg.model}: layers that reuse another layer's keys/values "
                                  f"(num_kv_shared_layers={config.num_kv_shared_layers}) cannot be recomputed one at "
                                  "a time")

    def _plan_for_device(self) -> P.Plan:
        device = device_memory(self.device) if self.device.type == "cuda" else None
        geo = geometry_of_store(self.store, self.cfg)
        host = host_memory(self.cfg, self.world, geo.store_bytes)  # the store built: what the host has left, and it
        return make_plan(geo, self.cfg, device, ranks=self.world.size, host=host)

    def _shared_stream(self) -> None:
        """With copies shared among the ranks: the same plan on every rank, and the gathers' process group."""
        self._gathers = None
        shards = self.plan.shards
        if shards == 1:
            return
        if shards != self.world.size:
            raise CapabilityError(f"the plan shares its copies among {shards} ranks but {self.world.size} run it: "
                                  "plan with the ranks that train (gpus, torchrun --nproc-per-node)")
        same_on_every_rank(" ".join(map(str, (*self.plan.setup, *self.plan.step))), self.world, "plan")
        self._gathers = gather_group(self.world)

    @staticmethod
    def _refuse_unsafe(plan: P.Plan) -> None:
        problems = check(plan)
        if problems:
            raise CapabilityError(f"refusing an unsafe plan: {problems[0]}" +
                                  (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))

    def _host_model(self) -> QLoRAModel:
        """The QLoRA model, its embeddings and lm_head in host memory; the store (and a streamed lm_head)
        page-locked where `pin_memory` asks."""
        store, pin = self.store, self.device.type == "cuda" and self.cfg.pin_memory
        if pin:
            store.pin()
        model = QLoRAModel(store, self.cfg, self.device, host_io=True)
        if pin:
            head = model.hf.get_output_embeddings().weight
            name = next((n for n, t in store.dense.items() if t.data_ptr() == head.data_ptr()), None)
            if name is not None:
                store.pin_dense(name)
        return model

    def _bind_weights(self, model: QLoRAModel) -> None:
        """Every layer's NF4 modules over its bytes in its group's device buffer."""
        for g in self.plan.groups:
            buf = self.buffers.views[g.buffer]
            for i in g.layers:
                for slot in self.store.layers[i].slots:
                    model.bind(slot, slot_tensors(buf, slot, base=g.start))

    def _runners(self, layers) -> list[Runner]:
        """Each layer's runner: kept or recomputed, through layer templates when there are some."""
        t, worker, compiled = self.templates, self._worker, self.cfg.compile
        if t is not None and self.plan.regenerated:
            raise CapabilityError("input_stride: regenerated inputs run eager (or compiled) forwards, not layer "
                                  "templates; drop cuda_graphs or input_stride")
        recompute = Recompute(layers, worker, self.saved, compiled, self.cfg.keep_attention,
                              frozenset(self.plan.regenerated)) if t is None else TemplateRecompute(
            layers, worker, self.saved, t, compiled)
        kept = Kept(layers, worker, compiled) if t is None else TemplateKept(layers, worker, t, compiled)
        return [kept if i in self.plan.kept_layers else recompute for i in range(len(layers))]

    def _load_setup(self) -> None:
        """The loads every step starts from: resident groups, the first streamed ones, a resident lm_head."""
        b = self.buffers
        handlers = {P.LOAD: b.load, P.LOAD_HEAD: b.load_head, P.GATHER: b.gather, P.GATHER_HEAD: b.gather_head}
        for op in self.plan.setup:
            handlers[op.kind](op)
        if self.plan.head_resident:
            self.buffers.load_head(None)

    # --- the model's hooks --------------------------------------------------------------------
    def _patch(self, model: QLoRAModel) -> None:
        """Layers record their arguments (prologue) or hand on their input (head); the embedding looks
        tokens up on the host; the lm_head reads its device copy."""
        last = len(model.layers) - 1
        for i, layer in enumerate(model.layers):
            layer.forward = self._layer_hook(i, i == last, type(layer).forward.__get__(layer))
        emb, head = model.hf.get_input_embeddings(), model.hf.get_output_embeddings()
        emb.to("cpu")
        emb_forward = type(emb).forward.__get__(emb)
        device, hidden = self.device, self.store.config.hidden_size
        # A plain lookup (no scale, no max_norm) gathers its rows with index_select, several times faster on
        # the host than F.embedding's bf16 path and the same bytes, into page-locked memory (the caching host
        # allocator's, reused step after step) that the device copies asynchronously.
        plain = type(emb).forward is torch.nn.Embedding.forward and emb.max_norm is None

        def embed(input_ids, *a, **k):
            if self._pass is _Pass.HEAD:  # only its shape and dtype matter: every layer hands on its input
                return torch.empty(*input_ids.shape, hidden, dtype=torch.bfloat16, device=device)
            ids = input_ids.to("cpu")
            if not (plain and not a and not k):
                return emb_forward(ids, *a, **k).to(device)
            rows = torch.empty(*ids.shape, emb.embedding_dim, dtype=emb.weight.dtype, pin_memory=device.type == "cuda")
            torch.index_select(emb.weight.detach(), 0, ids.reshape(-1), out=rows.view(-1, emb.embedding_dim))
            return rows.to(device, non_blocking=True)

        emb.forward = embed
        bias = head.bias

        def head_forward(x):
            self.buffers.acquire(HEAD_KEY)
            return torch.nn.functional.linear(x, self.buffers.head, bias)

        head.forward = head_forward

    def _layer_hook(self, i: int, last: bool, original):
        def forward(*args, **kwargs):
            if self._pass is _Pass.PLAIN:
                return original(*args, **kwargs)
            hidden, call = LayerCall.split(args, kwargs)
            step = self._step
            if self._pass is _Pass.HEAD:
                return step.leaf if last else hidden
            if call.tensors_requiring_grad():
                raise CapabilityError(f"layer {i}: an argument other than the hidden state requires grad; "
                                      "poros recomputes layers from their input alone")
            step.calls[(i, step.micro)] = call
            if i == 0:
                step.hidden[step.micro] = hidden
            if last:
                raise _Captured
            return hidden

        return forward

    def _run_model(self, what: _Pass, batch):
        self._pass = what
        try:
            # compiled layers only record or hand on here: eagerly (their compiled code is the runners')
            with torch.compiler.set_stance("force_eager") if self.cfg.compile else contextlib.nullcontext():
                return self.model(input_ids=batch.input_ids, labels=batch.labels, use_cache=False)
        except _Captured:
            return None
        finally:
            self._pass = _Pass.PLAIN

    # --- the step: an interpreter of the plan's operations --------------------------------------
    def accumulate(self, batches) -> list[torch.Tensor]:
        """Run the plan's step over `batches` (its grad_accum micro-batches): the scaled loss of each,
        LoRA gradients accumulated as resident QLoRA accumulates them."""
        if len(batches) != self.plan.grad_accum:
            raise CapabilityError(f"the plan is for {self.plan.grad_accum} micro-batches, got {len(batches)}")
        step = self._step = _Step(batches, [None] * len(batches))
        handlers = {P.LOAD: self.buffers.load, P.LOAD_HEAD: self.buffers.load_head, P.RELEASE: self._release,
                    P.RELEASE_HEAD: self._release, P.FORWARD: self._forward, P.HEAD: self._head,
                    P.BACKWARD: self._backward, P.GATHER: self.buffers.gather,
                    P.GATHER_HEAD: self.buffers.gather_head,
                    P.OFFLOAD: lambda op: self.saved.offload((op.layer, op.micro), op.buffer),
                    P.FETCH: lambda op: self.saved.fetch((op.layer, op.micro)), P.REGEN: self._regenerate}
        with sdpa_context(self.cfg.attention):
            for op in self.plan.step:
                handlers[op.kind](op)
            self._resolve()
        if self.reducer is not None:
            self.reducer.finish()
        self._step = None
        assert not len(self.saved) and not step.calls and not any(len(r) for r in self.runners), \
            "every saved input and kept activation is consumed by its backward"
        return step.losses

    def _resolve(self) -> None:
        """Wait for the backward in flight (its kernels enqueued) and take the gradient it produced; after
        a layer's last backward its gradients are whole (the reducer's cue)."""
        step = self._step
        if step.pending is not None:
            pending, m, i, k = step.pending
            step.pending = None
            step.grads[m] = pending.result()
            if self.reducer is not None and k in self._layer_final:
                self.reducer.layer_done(i)

    def _release(self, op: P.Op) -> None:
        self._resolve()  # the free event must follow every kernel that reads the buffer
        self.buffers.release(op.buffer if op.kind == P.RELEASE else (HEAD_KEY if op.buffer < 0 else op.buffer))
        if op.kind == P.RELEASE_HEAD and op.buffer >= 0:
            self.buffers.release(HEAD_KEY)

    def _forward(self, op: P.Op) -> None:
        i, m, step = op.layer, op.micro, self._step
        self.dropout_micro(m, len(step.batches))  # a recompute draws its forward's LoRA dropout masks
        if i == 0:
            step.micro = m
            self._run_model(_Pass.PROLOGUE, step.batches[m])
        self.buffers.acquire(self.plan.groups[op.group].buffer)
        step.hidden[m] = self.runners[i].forward((i, m), step.hidden[m], step.calls.pop((i, m)))

    def _regenerate(self, op: P.Op) -> None:
        j, m = op.layer, op.micro
        self.dropout_micro(m, len(self._step.batches))  # the masks the forward drew
        self.buffers.acquire(self.plan.groups[op.group].buffer)
        self.saved.put((j + 1, m), self.runners[j].regenerate((j, m)))
        self._regenerations += 1

    def _head(self, op: P.Op) -> None:
        m, step = op.micro, self._step
        if not self.plan.head_resident:
            self.buffers.acquire(HEAD_KEY)
        step.leaf = step.hidden.pop(m).detach().requires_grad_(True)
        out = self._run_model(_Pass.HEAD, step.batches[m])
        loss = out.loss / self.cfg.grad_accum
        loss.backward()
        step.grads[m] = step.leaf.grad
        step.leaf = None
        step.losses[m] = loss.detach()

    def _backward(self, op: P.Op) -> None:
        i, m, step = op.layer, op.micro, self._step
        self.dropout_micro(m, len(step.batches))
        self.buffers.acquire(self.plan.groups[op.group].buffer)
        k = step.backwards = step.backwards + 1

        def grad() -> torch.Tensor:  # the gradient at this layer's output, once the backward before is done
            self._resolve()
            return step.grads.pop(m)

        step.pending = (self.runners[i].backward((i, m), grad), m, i, k)
        if isinstance(step.pending[0], Done):  # computed already (serially, or by a template)
            self._resolve()

    # --- bookkeeping --------------------------------------------------------------------------
    def step(self, batches=None):
        self.buffers.reset_counters()
        self.saved.bytes_d2h = self.saved.bytes_h2d = 0
        self._regenerations = 0
        try:
            return super().step(batches)
        except torch.OutOfMemoryError as e:
            if self.allocator_limit.fraction is None:
                raise
            raise BudgetError(f"the plan for vram_budget {format_size(self.plan.budget)} needed more device memory "
                              f"than it predicted ({self.plan.memory.total / 1e9:.2f} GB), and the allocator is held "
                              "to the budget: give a larger --vram-budget, or drop --cuda-graphs or "
                              "--keep-activations") from e

    def counters(self) -> dict:
        out = self.buffers.counters()
        if self.plan.offload_inputs:
            out.update(input_bytes_d2h=self.saved.bytes_d2h, input_bytes_h2d=self.saved.bytes_h2d)
            out["bytes_h2d"] += self.saved.bytes_h2d
        out["peak_blocks_resident"] = sum(not b.resident for b in self.plan.buffers)
        if self.plan.regenerated:
            out["regenerations"] = self._regenerations
        if self.cfg.keep_attention:  # fused attention calls of the recomputes: taken from the forward, or run again
            recompute = next((r for r in self.runners if isinstance(r, Recompute)), None)
            calls = recompute.attention_calls if recompute is not None else {}
            out.update(attention_replayed=calls.get("replayed", 0), attention_computed=calls.get("computed", 0))
            for k in calls:
                calls[k] = 0
        if self.reducer is not None:
            out["allreduce_bytes"] = self.reducer.bytes
            self.reducer.bytes = 0
        if self.templates is not None:
            out.update(self.templates.counters())
        return out

    def close(self) -> None:
        # the patched forwards close over self: drop them so nothing keeps the buffers alive
        for layer in self.qlora.layers:
            layer.__dict__.pop("forward", None)
        for m in (self.qlora.hf.get_input_embeddings(), self.qlora.hf.get_output_embeddings()):
            m.__dict__.pop("forward", None)
        self.saved.clear()
        for runner in self.runners:
            runner.clear()
        self._step = None
        if self.templates is not None:
            self.templates.clear()
        self._stop_worker()
        del self.buffers
        release_group(self._gathers)
        self._gathers = None
        super().close()
        self._held.close()
        self.allocator_limit.release()  # after the device memory is freed, so nothing allocates past the cap

    @contextlib.contextmanager
    def alone(self):
        """`Trainer.alone`, and with a shared stream each load copies every byte and no gather runs: the
        same plan streamed over this device's link alone."""
        held = self.buffers.world
        self.buffers.world = SINGLE
        try:
            with super().alone():
                yield self
        finally:
            self.buffers.world = held

    def _stop_worker(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def use_layer_templates(self, capture: bool) -> None:
        """Run every layer's forward, and its recompute + backward, through layer templates
        (poros/engine/graphs.py): replayed from CUDA graphs with `capture` (what `cuda_graphs: true` selects),
        eagerly without (CPU tests)."""
        self.templates = LayerTemplates(capture=capture, compiled=self.cfg.compile)
        self._stop_worker()
        self.runners = self._runners(self.qlora.layers)
