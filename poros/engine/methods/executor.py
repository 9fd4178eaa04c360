"""The executor: runs a plan (poros/engine/planning/plan.py) on the device, bitwise equal to resident QLoRA.

The very same modules and kernels run as in resident training; only where the NF4 bytes sit and when
they are copied differ. `PorosTrainer` sets a run up: the plan (made for the device, or the one it is given,
checked), torch's allocator held to its budget, the device buffers, every layer's NF4 modules bound to its
group's buffer, each layer's runner and the loads every step starts from; and it reports what a step copied.
Per micro-batch, the Hugging Face forward runs as a prologue and as the head (poros/engine/runtime/model_hooks.py),
and the plan's operations run the layers between them (poros/engine/runtime/interpreter.py).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import torch

from poros.config import Method
from poros.engine.planning import plan as P
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.rules import check
from poros.engine.runtime.allocator_limit import AllocatorLimit, held_text
from poros.engine.runtime.buffers import DeviceBuffers
from poros.engine.parallel.distributed import (SINGLE, GradReducer, World, gather_group, release_group,
                                              same_on_every_rank)
from poros.engine.runtime.templates import LayerTemplates
from poros.engine.model import kept_attention
from poros.engine.runtime.interpreter import PlanInterpreter
from poros.engine.runtime.model_hooks import ModelHooks, ModelPass
from poros.engine.runtime.nvml import device_memory
from poros.engine.planning.budget import make_plan
from poros.engine.model.qlora import QLoRAModel
from poros.engine.runtime.runners import Kept, Recompute, Runner, TemplateKept, TemplateRecompute
from poros.engine.runtime.saved_inputs import SavedInputs, host_memory
from poros.engine.model.compiling import backward_keeps_saved_tensors, compile_layers
from poros.engine.methods.trainer import Trainer
from poros.errors import BudgetError, CapabilityError
from poros.sizes import format_size
from poros.store.arena import slot_tensors


def geometry_of_store(store, cfg) -> Geometry:
    """The planner's view of a built store (the same numbers `Geometry.of_config` derives from shapes)."""
    return Geometry.of_config(cfg.model, store.config, cfg.lora_targets, store.double_quant)


class PorosTrainer(ModelHooks, PlanInterpreter, Trainer):
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
        self._pass, self._step, self._gathers, self._host_ids = ModelPass.PLAIN, None, None, None
        self._regenerations = 0  # regenerate operations run this step (input_stride)
        super().__init__(store, cfg, world)

    def _distribute(self) -> None:
        """Each layer's LoRA gradients reduced over the ranks (`GradReducer`) once the backward of its last
        micro-batch is enqueued."""
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
            with self._within_budget():
                return self._make_within_limit()
        except BaseException:  # a trainer never built is never closed: the cap goes now
            self.allocator_limit.release()
            self._held.close()
            raise

    @contextlib.contextmanager
    def _within_budget(self):
        """An out-of-memory error under the allocator's cap as one BudgetError line: what the plan predicted and
        what the allocator held when it ran out, CUDA graphs' pools apart."""
        try:
            yield
        except torch.OutOfMemoryError:
            if self.allocator_limit.fraction is None:
                raise
            undo = "".join(f", or {a}" for a, on in (("--no-cuda-graphs", self.cfg.cuda_graphs),
                                                     ("--no-keep-activations", bool(self.plan.kept_layers))) if on)
            raise BudgetError(f"the plan for vram_budget {format_size(self.plan.budget)} needed more device memory "
                              f"than it predicted ({self.plan.memory.total / 1e9:.2f} GB of it for the process; "
                              f"{held_text(self.device)}), and the allocator is held to the budget: give a larger "
                              f"--vram-budget{undo}") from None

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
                        if self.cfg.backward_overlaps else None)
        self.templates = LayerTemplates(capture=True, compiled=self.cfg.compile) if self.cfg.cuda_graphs else None
        self.saved = SavedInputs(self.plan, self.device, self.buffers.copy_stream, pin=self.cfg.pin_memory)
        self.runners = self._runners(model.layers)
        if self.cfg.compile:
            compile_layers(model.layers, mlp=self.cfg.compile_mlp)
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
        recompute = Recompute(layers, worker, self.saved, compiled, self.cfg.keep_attention,
                              frozenset(self.plan.regenerated),
                              eager_mlp=not (compiled and self.cfg.compile_mlp)) if t is None else TemplateRecompute(
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

    # --- bookkeeping --------------------------------------------------------------------------
    def step(self, batches=None):
        self.buffers.reset_counters()
        self.saved.bytes_d2h = self.saved.bytes_h2d = 0
        self._regenerations = 0
        with self._within_budget():
            return super().step(batches)

    # the parity gate drives a step in its two halves (poros/engine/verify/parity.py `take_step`): each is held to
    # the budget as a whole step is
    def accumulate_step(self, batches):
        with self._within_budget():
            return super().accumulate_step(batches)

    def optimizer_step(self) -> None:
        with self._within_budget():
            super().optimizer_step()

    def counters(self, deferred: bool = False) -> dict:
        out = self.buffers.counters(deferred)
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
        (poros/engine/runtime/graphs.py): replayed from CUDA graphs with `capture` (what `cuda_graphs: true` selects),
        eagerly without (CPU tests)."""
        self.templates = LayerTemplates(capture=capture, compiled=self.cfg.compile)
        self._stop_worker()
        self.runners = self._runners(self.qlora.layers)
