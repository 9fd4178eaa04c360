"""The executor: runs a plan (poros/engine/plan.py) on the device, bitwise equal to resident QLoRA.

The very same modules and kernels run as in resident training; only where the NF4 bytes sit and when
they are copied differ. Per micro-batch, a *prologue* runs the Hugging Face forward with every
decoder layer replaced by a recorder: it computes what the model computes before its layers
(embeddings, rotary tables, masks) and records each layer's call arguments, then stops. The plan's
operations then run the layers themselves:

  forward   a layer without autograd, its input kept for the recompute;
  head      the Hugging Face forward again, each layer handing on its input and the last one a leaf
            holding the last hidden state, so the final norm, lm_head and loss run exactly as in the
            model, with autograd, and backpropagate to the leaf;
  backward  the layer's forward again from its saved input, with autograd, and its backward from the
            gradient at its output (one layer's activations on the device at a time). With
            `overlap_backward` the next backward's recompute is enqueued by this thread while a
            worker thread enqueues the current backward (the same kernels on the same stream; the
            host-side launch work overlaps). With `cuda_graphs` each layer's forward and recompute +
            backward replay from a CUDA graph (poros/engine/graphs.py).

Copies run on their own stream. Each buffer has a `ready` event (recorded after a load) that the
compute stream waits for on its first read, and a `free` event (recorded at a release) that the next
load into it waits for: every ordering comes from the plan, whose rules `plan.check` verifies.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from poros.config import Method
from poros.engine import plan as P
from poros.engine.attention import sdpa_context
from poros.engine.distributed import SINGLE, GradReducer, World
from poros.engine.graphs import LayerTemplates
from poros.engine.plan import make_plan
from poros.engine.qlora import QLoRAModel, bind_nf4
from poros.engine.trainer import Trainer
from poros.errors import CapabilityError
from poros.store.arena import absmax_view, weight_view


class _Captured(Exception):
    """Ends a prologue once the last layer's arguments are recorded."""


IN_TEMPLATE = object()  # a kept layer's activations held by its layer template (poros/engine/graphs.py KeptTemplate)


class _Done:
    """An already computed result with a future's `result()` (the serial backward)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def geometry_of_store(store, cfg) -> P.Geometry:
    """The planner's view of a built store (the same numbers `Geometry.of_config` derives from shapes)."""
    return P.Geometry.of_config(cfg.model, store.config, cfg.lora_targets)


GRAPH_POOL_WARN = 0.25  # a budget's share beyond which the CUDA graphs' own pool is worth a warning


def warn_graph_pool(plan: P.Plan) -> None:
    """A budget holds the allocated peak; CUDA graphs also reserve a pool of their own beside it. Where that
    pool is a large share of the budget (long context), say so: the device needs both."""
    if plan.budget and plan.graph_pool > GRAPH_POOL_WARN * plan.budget:
        warnings.warn(f"under cuda_graphs the layer templates' pool reserves at least {plan.graph_pool / 1e9:.1f} GB "
                      f"beyond the {plan.budget / 1e9:.1f} GB budget (it holds the allocated peak only); at this "
                      "length graphs save little: drop cuda_graphs (and overlap_backward) to stay within the budget",
                      RuntimeWarning, stacklevel=3)


class DeviceBuffers:
    """The plan's buffers on the device, the copies into them and the events that order them."""

    def __init__(self, plan: P.Plan, store, device: torch.device, head_host: torch.Tensor):
        self.plan, self.store, self.device = plan, store, device
        self.cuda = device.type == "cuda"
        stream = [b for b in plan.buffers if not b.resident]
        size = stream[0].nbytes if stream else 0
        pad = plan.head_pad
        lead = pad if plan.head_buffer == 0 else 0
        self.region = torch.empty(lead + len(stream) * size + (pad - lead), dtype=torch.uint8, device=device)
        self.views: dict[int, torch.Tensor] = {b.index: self.region[lead + b.index * size: lead + (b.index + 1) * size]
                                               for b in stream}
        for b in plan.buffers:
            if b.resident:
                self.views[b.index] = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
        self.head_host = head_host
        nbytes = head_host.numel() * head_host.element_size()
        if plan.head_buffer is not None:
            o = 0 if plan.head_buffer == 0 else size
            head_region = self.region[o: o + nbytes]
        else:
            head_region = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.head = head_region.view(head_host.dtype).view(head_host.shape)
        self.ready, self.free = {}, {}
        self.fresh: set[int] = set()  # buffers loaded since the compute stream last waited for them
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
        self.reset_counters()

    def reset_counters(self) -> None:
        self.bytes_h2d = self.loads = 0
        self.copy_s = self.copy_wait_s = 0.0
        self._copy_events, self._wait_events = [], []

    def _copy(self, key: int, dst: torch.Tensor, src: torch.Tensor, after: tuple[int, ...] = ()) -> None:
        """Copy host->device on the copy stream once the readers of `key` (and of `after`) are done;
        `key`'s ready event follows the copy."""
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                for k in (key, *after):
                    if k in self.free:
                        self.copy_stream.wait_event(self.free[k])
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.copy_stream)
                dst.copy_(src, non_blocking=True)
                end.record(self.copy_stream)
                self.ready[key] = end
                self._copy_events.append((start, end))
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            self.copy_s += time.perf_counter() - t0
            self.copy_wait_s = self.copy_s  # synchronous: every copy is waited for
        self.fresh.add(key)
        self.bytes_h2d += src.numel() * src.element_size()

    def load(self, op: P.Op) -> None:
        g = self.plan.groups[op.group]
        self._copy(op.buffer, self.views[op.buffer][: g.nbytes], self.store.arena[g.start: g.end])
        self.loads += 1

    def load_head(self, op: P.Op | None) -> None:
        """The lm_head weight into its region: a lent buffer (`op.buffer`) or its own."""
        lent = () if op is None or op.buffer < 0 else (op.buffer,)
        self._copy(HEAD_KEY, self.head, self.head_host.detach(), after=lent)

    def acquire(self, key: int) -> None:
        """Make the compute stream wait for the last load into buffer `key` (once per load)."""
        if key not in self.fresh:
            return
        self.fresh.discard(key)
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(self.ready[key])
            after.record(stream)
            self._wait_events.append((before, after))

    def release(self, key: int) -> None:
        """Work reading buffer `key` is enqueued: a load into it may follow once that work is done."""
        if self.cuda:
            event = self.free.get(key) or torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.free[key] = event

    def counters(self) -> dict:
        if self.cuda and (self._wait_events or self._copy_events):
            torch.cuda.synchronize(self.device)
            self.copy_wait_s += sum(a.elapsed_time(b) for a, b in self._wait_events) / 1e3
            self.copy_s += sum(a.elapsed_time(b) for a, b in self._copy_events) / 1e3
            self._wait_events, self._copy_events = [], []
        return {"bytes_h2d": self.bytes_h2d, "block_copies": self.loads, "copy_s": self.copy_s,
                "copy_wait_s": self.copy_wait_s}


HEAD_KEY = -1  # the lm_head's own region when it borrows no buffer


class SavedInputs:
    """Each layer's input, kept for its recompute: on the device, or (plan.offload_inputs) copied to
    pinned host memory in forward on a device->host stream, and brought back on the copy stream, a
    window of backward operations ahead, into fresh device memory. The bytes are the same either way."""

    def __init__(self, plan: P.Plan, device: torch.device, copy_stream=None):
        self.offload, self.device = plan.offload_inputs, device
        self.cuda = device.type == "cuda"
        self.copy_stream = copy_stream
        self.d2h = torch.cuda.Stream(device) if self.cuda and self.offload else None
        self.window = plan.input_window
        self.kept: dict = {}  # key -> device tensor
        self.host: dict = {}  # key -> (host tensor, event after its device->host copy)
        self.ready: dict = {}  # key -> event after its host->device copy
        self._pool: list[torch.Tensor] = []  # host buffers, reused step after step
        self.bytes_d2h = self.bytes_h2d = 0

    def put(self, key, x: torch.Tensor) -> None:
        if not self.offload:
            self.kept[key] = x
            return
        host = self._pool.pop() if self._pool and self._pool[-1].shape == x.shape else torch.empty(
            x.shape, dtype=x.dtype, pin_memory=self.cuda)
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                host.copy_(x, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.d2h)
            x.record_stream(self.d2h)  # its memory is not reused before the copy ends
        else:
            host.copy_(x)
            done = None
        self.host[key] = (host, done)
        self.bytes_d2h += x.numel() * x.element_size()

    def prefetch(self, key) -> None:
        if key in self.kept or key not in self.host:
            return
        host, done = self.host.pop(key)
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(done)
                dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                dev.copy_(host, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            self.ready[key] = (ready, host)
        else:
            dev = host.clone()
            self._pool.append(host)
        self.kept[key] = dev
        self.bytes_h2d += dev.numel() * dev.element_size()

    def take(self, key) -> torch.Tensor:
        self.prefetch(key)
        x = self.kept.pop(key)
        if key in self.ready:
            ready, host = self.ready.pop(key)
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            x.record_stream(stream)  # allocated on the copy stream, read here
            self._pool.append(host)  # reusable once the copy is done: the next put follows this wait
        return x

    def peek(self, key) -> torch.Tensor:
        """The input without giving it up (a template that may decline still needs it)."""
        x = self.take(key)
        self.kept[key] = x
        return x

    def __len__(self) -> int:
        return len(self.kept) + len(self.host)

    def clear(self) -> None:
        self.kept.clear()
        self.host.clear()
        self.ready.clear()
        self._pool.clear()


class PorosTrainer(Trainer):
    """QLoRA whose decoder weights reach the device as `plan` says; arithmetic identical to resident.

    Args:
        plan: run this plan instead of the one `cfg` asks for (tests; it is checked unless `check_plan`
            is False, which only negative controls use).
    """

    method = Method.POROS.value

    def __init__(self, store, cfg, world: World = SINGLE, *, plan: P.Plan | None = None, check_plan: bool = True):
        self._given_plan, self._check_plan = plan, check_plan
        super().__init__(store, cfg, world)

    def _distribute(self) -> None:
        """Each layer's LoRA gradients all-reduced once the backward of its last micro-batch is enqueued."""
        self.reducer = GradReducer([[p for p in layer.parameters() if p.requires_grad] for layer in self.qlora.layers],
                                   self.world)

    def _make_model(self) -> QLoRAModel:
        store, cfg = self.store, self.cfg
        if getattr(store.config, "num_kv_shared_layers", 0):
            raise CapabilityError(f"{cfg.model}: layers that reuse another layer's keys/values (num_kv_shared_layers="
                                  f"{store.config.num_kv_shared_layers}) cannot be recomputed one at a time")
        geo = geometry_of_store(store, cfg)
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        self.plan = self._given_plan or make_plan(geo, cfg, free)
        warn_graph_pool(self.plan)
        if self._check_plan:
            problems = P.check(self.plan)
            if problems:
                raise CapabilityError(f"refusing an unsafe plan: {problems[0]}" +
                                      (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        if self.device.type == "cuda" and cfg.pin_memory:
            store.pin()
        model = QLoRAModel(store, cfg, self.device, host_io=True)
        head = model.hf.get_output_embeddings().weight
        if self.device.type == "cuda" and cfg.pin_memory:
            name = next((n for n, t in store.dense.items() if t.data_ptr() == head.data_ptr()), None)
            if name is not None:
                store.pin_dense(name)
        self.buffers = DeviceBuffers(self.plan, store, self.device, head)
        for g in self.plan.groups:
            buf = self.buffers.views[g.buffer]
            for i in g.layers:
                for slot in store.layers[i].slots:
                    bind_nf4(model.linear4bit[slot.name], weight_view(buf, slot, base=g.start),
                             absmax_view(buf, slot, base=g.start), model.code, slot.shape)
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="poros-backward")
                        if cfg.overlap_backward and not cfg.cuda_graphs else None)
        self._templates = LayerTemplates(capture=True) if cfg.cuda_graphs else None
        self.saved = SavedInputs(self.plan, self.device, getattr(self.buffers, "copy_stream", None))
        self._kept_layers = set(self.plan.kept_layers)
        # (layer, micro) -> (input, output), or IN_TEMPLATE
        self._kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | object] = {}
        self._backward_keys = [(op.layer, op.micro) for op in self.plan.step if op.kind == P.BACKWARD]
        last = {layer: k for k, (layer, _) in enumerate(self._backward_keys)}
        self._layer_final = {k + 1 for k in last.values()}  # backward counts after which a layer's gradients are whole
        self._patch(model)
        for op in self.plan.setup:
            (self.buffers.load_head if op.kind == P.LOAD_HEAD else self.buffers.load)(op)
        if self.plan.head_resident:
            self.buffers.load_head(None)
        return model

    # --- the model's hooks --------------------------------------------------------------------
    def _patch(self, model: QLoRAModel) -> None:
        """Layers record their arguments (prologue) or hand on their input (head); the embedding looks
        tokens up on the host; the lm_head reads its device copy."""
        self._mode = "plain"
        self._micro = 0
        self._calls: dict[tuple[int, int], tuple] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._grads: dict[int, torch.Tensor] = {}
        self._leaf = None
        self._last = len(model.layers) - 1
        for i, layer in enumerate(model.layers):
            layer.forward = self._layer_hook(i, type(layer).forward.__get__(layer))
        emb, head = model.hf.get_input_embeddings(), model.hf.get_output_embeddings()
        emb.to("cpu")
        emb_forward = type(emb).forward.__get__(emb)
        device, hidden = self.device, self.store.config.hidden_size

        def embed(input_ids, *a, **k):
            if self._mode == "head":  # only its shape and dtype matter: every layer hands on its input
                return torch.empty(*input_ids.shape, hidden, dtype=torch.bfloat16, device=device)
            return emb_forward(input_ids.to("cpu"), *a, **k).to(device)

        emb.forward = embed
        bias = head.bias

        def head_forward(x):
            self.buffers.acquire(HEAD_KEY)
            return torch.nn.functional.linear(x, self.buffers.head, bias)

        head.forward = head_forward

    def _layer_hook(self, i: int, original):
        def forward(*args, **kwargs):
            if self._mode == "plain":
                return original(*args, **kwargs)
            if "hidden_states" in kwargs:
                hidden, rest, kw_hidden = kwargs["hidden_states"], args, True
            else:
                hidden, rest, kw_hidden = args[0], args[1:], False
            if self._mode == "capture":
                kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                for t in list(rest) + list(kw.values()):
                    if torch.is_tensor(t) and t.requires_grad:
                        raise CapabilityError(f"layer {i}: an argument other than the hidden state requires grad; "
                                              "poros recomputes layers from their input alone")
                self._calls[(i, self._micro)] = (rest, kw, kw_hidden)
                if i == 0:
                    self._hidden[self._micro] = hidden
                if i == self._last:
                    raise _Captured
                return hidden
            return self._leaf if i == self._last else hidden  # head mode

        return forward

    def _run_model(self, mode: str, batch):
        self._mode = mode
        try:
            return self.model(input_ids=batch.input_ids, labels=batch.labels, use_cache=False)
        except _Captured:
            return None
        finally:
            self._mode = "plain"

    # --- the step -----------------------------------------------------------------------------
    def accumulate(self, batches) -> list[torch.Tensor]:
        """Run the plan's step over `batches` (its grad_accum micro-batches): the scaled loss of each,
        LoRA gradients accumulated as resident QLoRA accumulates them."""
        if len(batches) != self.plan.grad_accum:
            raise CapabilityError(f"the plan is for {self.plan.grad_accum} micro-batches, got {len(batches)}")
        self._batches = batches
        self._losses: list = [None] * len(batches)
        self._pending = None
        self._backward_done = 0
        handlers = {P.LOAD: self.buffers.load, P.LOAD_HEAD: self.buffers.load_head, P.RELEASE: self._release,
                    P.RELEASE_HEAD: self._release, P.FORWARD: self._forward, P.HEAD: self._head,
                    P.BACKWARD: self._backward}
        with sdpa_context(self.cfg.attention):
            for op in self.plan.step:
                handlers[op.kind](op)
            self._resolve()
        if self.reducer is not None:
            self.reducer.finish()
        self._batches = None
        assert not len(self.saved) and not self._calls and not self._kept, \
            "every saved input and kept activation is consumed by its backward"
        return self._losses

    def _resolve(self) -> None:
        """Wait for the backward in flight (its kernels enqueued) and take the gradient it produced."""
        if self._pending is not None:
            future, m, i, k = self._pending
            self._pending = None
            self._grads[m] = future.result()
            self._layer_grads_done(i, k)

    def _layer_grads_done(self, i: int, k: int) -> None:
        """Backward number `k` (of layer i) is enqueued: after a layer's last, its gradients are whole."""
        if self.reducer is not None and k in self._layer_final:
            self.reducer.layer_done(i)

    def _release(self, op: P.Op) -> None:
        self._resolve()  # the free event must follow every kernel that reads the buffer
        self.buffers.release(op.buffer if op.kind == P.RELEASE else (HEAD_KEY if op.buffer < 0 else op.buffer))
        if op.kind == P.RELEASE_HEAD and op.buffer >= 0:
            self.buffers.release(HEAD_KEY)

    def _forward(self, op: P.Op) -> None:
        i, m = op.layer, op.micro
        if i == 0:
            self._micro = m
            self._run_model("capture", self._batches[m])
        self.buffers.acquire(self.plan.groups[op.group].buffer)
        x = self._hidden[m]
        if i in self._kept_layers:  # resident QLoRA's forward: with autograd, its activations kept for backward
            rest, kwargs, kw_hidden = self._calls.pop((i, m))
            layer = self.qlora.layers[i]
            if self._templates is not None:  # in the layer's own template (two graphs), else eagerly
                out = self._templates.kept_forward(i, m, layer, x, rest, kwargs, kw_hidden)
                if out is not None:
                    self._kept[(i, m)] = IN_TEMPLATE
                    self._hidden[m] = out[0] if isinstance(out, tuple) else out
                    return
            leaf = x.detach().requires_grad_(True)
            with torch.enable_grad():
                out = layer(*rest, hidden_states=leaf, **kwargs) if kw_hidden else layer(leaf, *rest, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
            self._kept[(i, m)] = (leaf, h)
            self._hidden[m] = h.detach()
            return
        self.saved.put((i, m), x)
        rest, kwargs, kw_hidden = self._calls[(i, m)]
        out = None
        if self._templates is not None:
            out = self._templates.run(i, self.qlora.layers[i], x, rest, kwargs, kw_hidden)
        if out is None:
            layer = self.qlora.layers[i]
            with torch.no_grad():
                out = layer(*rest, hidden_states=x, **kwargs) if kw_hidden else layer(x, *rest, **kwargs)
        self._hidden[m] = out[0] if isinstance(out, tuple) else out

    def _head(self, op: P.Op) -> None:
        m = op.micro
        if not self.plan.head_resident:
            self.buffers.acquire(HEAD_KEY)
        self._leaf = self._hidden.pop(m).detach().requires_grad_(True)
        out = self._run_model("head", self._batches[m])
        loss = out.loss / self.cfg.grad_accum
        loss.backward()
        self._grads[m] = self._leaf.grad
        self._leaf = None
        self._losses[m] = loss.detach()

    def _recompute(self, i: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's forward again, with autograd, from its saved input: (input leaf, output)."""
        x = self.saved.take((i, m)).detach().requires_grad_(True)
        rest, kwargs, kw_hidden = self._calls.pop((i, m))
        layer = self.qlora.layers[i]
        out = layer(*rest, hidden_states=x, **kwargs) if kw_hidden else layer(x, *rest, **kwargs)
        return x, out[0] if isinstance(out, tuple) else out

    def _backward(self, op: P.Op) -> None:
        i, m = op.layer, op.micro
        self.buffers.acquire(self.plan.groups[op.group].buffer)
        k = self._backward_done = self._backward_done + 1
        for key in self._backward_keys[k: k + self.saved.window]:  # offloaded inputs, a window ahead
            self.saved.prefetch(key)
        kept = self._kept.pop((i, m), None)
        if kept is IN_TEMPLATE:
            self._resolve()
            self._grads[m] = self._templates.kept_backward(i, m, self._grads[m])
            self._layer_grads_done(i, k)
            return
        if kept is not None:
            x, h = kept  # the forward's own activations: nothing to recompute
        elif self._templates is None:
            x, h = self._recompute(i, m)  # enqueued while the backward in flight runs (overlap_backward)
        self._resolve()
        if kept is None and self._templates is not None:
            rest, kwargs, kw_hidden = self._calls[(i, m)]
            out = self._templates.run(i, self.qlora.layers[i], self.saved.peek((i, m)), rest, kwargs, kw_hidden,
                                      self._grads[m])
            if out is not None:
                self.saved.take((i, m))
                del self._calls[(i, m)]
                self._grads[m] = out
                self._layer_grads_done(i, k)
                return
            x, h = self._recompute(i, m)  # this layer's template declined: eagerly
        grad = self._grads.pop(m)

        def run() -> torch.Tensor:
            torch.autograd.backward(h, grad)
            return x.grad

        self._pending = (_Done(run()) if self._worker is None else self._worker.submit(run), m, i, k)

    # --- bookkeeping --------------------------------------------------------------------------
    def step(self, batches=None):
        self.buffers.reset_counters()
        self.saved.bytes_d2h = self.saved.bytes_h2d = 0
        return super().step(batches)

    def counters(self) -> dict:
        out = self.buffers.counters()
        if self.plan.offload_inputs:
            out.update(input_bytes_d2h=self.saved.bytes_d2h, input_bytes_h2d=self.saved.bytes_h2d)
            out["bytes_h2d"] += self.saved.bytes_h2d
        out["peak_blocks_resident"] = sum(not b.resident for b in self.plan.buffers)
        if self.reducer is not None:
            out["allreduce_bytes"] = self.reducer.bytes
            self.reducer.bytes = 0
        if self._templates is not None:
            out.update(self._templates.counters())
        return out

    def close(self) -> None:
        # the patched forwards close over self: drop them so nothing keeps the buffers alive
        for layer in self.qlora.layers:
            layer.__dict__.pop("forward", None)
        for m in (self.qlora.hf.get_input_embeddings(), self.qlora.hf.get_output_embeddings()):
            m.__dict__.pop("forward", None)
        self.saved.clear()
        self._kept.clear()
        self._calls.clear()
        self._hidden.clear()
        self._grads.clear()
        if self._templates is not None:
            self._templates.clear()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self._leaf = None
        del self.buffers
        super().close()

    def use_layer_templates(self, capture: bool) -> None:
        """Run every layer's forward, and its recompute + backward, through layer templates
        (poros/engine/graphs.py): replayed from CUDA graphs with `capture` (what `cuda_graphs: true` selects),
        eagerly without (CPU tests)."""
        self._templates = LayerTemplates(capture=capture)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
