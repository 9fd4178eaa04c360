"""Blockwise residency: train with only a block of K decoder layers on the device at a time.

Schedule of one micro-batch (the same modules and kernels as resident QLoRA, so the result is
bitwise identical):
  forward   blocks 0..B-1 without autograd, keeping each block's input hidden state;
  head      final norm, lm_head and loss with autograd, from a leaf on the last hidden state;
  backward  blocks B-1..0, and within a block its layers last to first: recompute the layer's
            forward from its saved input with autograd and backpropagate the incoming gradient;
            LoRA grads accumulate as in resident training. Recomputing layer by layer rather than
            block by block holds one layer's activations instead of K, for one saved input
            (seq x hidden) per layer.
            At seq 512 a layer's recompute and backward are bound by host-side launch work, not by
            the GPU, so with `overlap_backward` layer i's backward is enqueued by a worker thread
            while this thread enqueues layer i-1's recompute (which needs only its saved input):
            the same kernels on the same stream, two layers' activations held instead of one.
Block b always lives in device buffer b % 2, so every Linear4bit is bound once to a fixed view.
A buffer is refilled only after the compute stream has passed the event recorded when the last
block using it finished its backward: bitsandbytes' MatMul4Bit keeps the packed weight on its
autograd context (outside save_for_backward), so refilling earlier corrupts gradients silently.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from poros.errors import CapabilityError
from poros.graphs import LayerTemplates
from poros.modeling import QLoRAModel, bind_nf4
from poros.offload import ActivationOffloader, offloaded_layers
from poros.store import absmax_view, weight_view
from poros.streaming import Block, BlockStreamer, plan_blocks
from poros.train import Trainer, sdpa_context


class _Done:
    """An already computed result with a future's `result()` (the serial backward)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class PorosTrainer(Trainer):
    """QLoRA with blockwise residency; arithmetic identical to `ResidentTrainer`."""

    method = "poros"

    def _make_model(self) -> QLoRAModel:
        store, cfg = self.store, self.cfg
        if getattr(store.config, "num_kv_shared_layers", 0):
            raise CapabilityError(f"{cfg.model}: layers that reuse another layer's keys/values (num_kv_shared_layers="
                                  f"{store.config.num_kv_shared_layers}) cannot be recomputed one at a time")
        if self.device.type == "cuda" and cfg.pin_memory:
            store.pin()
        model = QLoRAModel(store, cfg, self.device, host_io=True)
        self.blocks = plan_blocks(store, cfg.block_size)
        head = model.hf.get_output_embeddings().weight
        self.head_bytes = head.numel() * head.element_size()
        self.streamer = BlockStreamer(store, self.blocks, self.device, head_bytes=self.head_bytes)
        self.block_of = {}
        for blk in self.blocks:
            buf = self.streamer.buffers[self.streamer.slot(blk.index)]
            for i in range(blk.first, blk.stop):
                self.block_of[i] = blk
                for slot in store.layers[i].slots:
                    packed = weight_view(buf, slot, base=blk.start)
                    absmax = absmax_view(buf, slot, base=blk.start)
                    bind_nf4(model.linear4bit[slot.name], packed, absmax, model.code, slot.shape)
        self.offload_layers = offloaded_layers(len(store.layers), self.blocks[-1].first, cfg.activation_offload)
        self.offloader = ActivationOffloader(self.device, getattr(self.streamer, "copy_stream", None))
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="poros-backward")
                        if cfg.overlap_backward and not cfg.cuda_graphs else None)
        self._templates = LayerTemplates(capture=True) if cfg.cuda_graphs else None
        self._patch_layers(model)
        self._patch_io(model)
        self.fault_refill_before_backward = False  # negative control for the gate's tests
        return model

    # --- embeddings and lm_head: host memory, on the device only while needed ----------------
    def _patch_io(self, model: QLoRAModel) -> None:
        """Embedding lookups run on the host (a gather is exact anywhere); the lm_head weight is
        copied into a lent block buffer during the last block's forward, used by the head, and
        the buffer handed back after the head's backward."""
        emb, head = model.hf.get_input_embeddings(), model.hf.get_output_embeddings()
        emb.to("cpu")
        emb_forward = type(emb).forward.__get__(emb)
        device = self.device
        emb.forward = lambda input_ids, *a, **k: emb_forward(input_ids.to("cpu"), *a, **k).to(device)
        self._head_host = head.weight
        self._head_dev = None
        if self.device.type == "cuda" and self.cfg.pin_memory:
            name = self._head_store_name()
            if name is not None:
                self.store.pin_dense(name)
        bias = head.bias

        def head_forward(x):
            if self._head_dev is None:  # not prefetched (called outside a poros step)
                self._prefetch_head()
            self.streamer.acquire_head()
            return torch.nn.functional.linear(x, self._head_dev, bias)

        head.forward = head_forward

    def _head_store_name(self) -> str | None:
        """The store's dense entry holding the lm_head weight (the embedding's, when tied: a tied
        checkpoint has no `lm_head.weight` entry)."""
        ptr = self._head_host.data_ptr()
        return next((n for n, t in self.store.dense.items() if t.data_ptr() == ptr), None)

    def _prefetch_head(self) -> None:
        self._head_dev = self.streamer.load_head(self._head_host.detach())

    # --- layer interception ---------------------------------------------------------------
    def _patch_layers(self, model: QLoRAModel) -> None:
        self._mode = "plain"  # "stream" only inside a poros forward
        self._inputs: dict[int, torch.Tensor] = {}
        self._calls: dict[int, tuple] = {}
        self._graphs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # offloaded layers: (input leaf, output)
        for i, layer in enumerate(model.layers):
            layer.forward = self._make_forward(i, type(layer).forward.__get__(layer))

    def _make_forward(self, i: int, original):
        def forward(*args, **kwargs):
            if self._mode != "stream":
                return original(*args, **kwargs)
            return self._stream_layer(i, original, args, kwargs)

        return forward

    def _stream_layer(self, i: int, original, args, kwargs):
        blk = self.block_of[i]
        if "hidden_states" in kwargs:
            hidden, rest, kw_hidden = kwargs["hidden_states"], args, True
        else:
            hidden, rest, kw_hidden = args[0], args[1:], False
        for t in list(rest) + list(kwargs.values()):
            if torch.is_tensor(t) and t.requires_grad and t is not hidden:
                raise CapabilityError(f"layer {i}: an argument other than the hidden state requires grad; "
                                      "poros recomputes layers from their input alone")
        if i == blk.first:
            self.streamer.acquire(blk.index)
            self.streamer.prefetch(blk.index + 1)
            if blk.index == len(self.blocks) - 1:
                self._prefetch_head()
        if i in self.offload_layers:
            out = self._forward_keeping_graph(i, original, hidden, rest, kwargs, kw_hidden)
        else:
            self._inputs[i] = hidden
            self._calls[i] = call = (rest, {k: v for k, v in kwargs.items() if k != "hidden_states"}, kw_hidden)
            out = None
            if self._templates is not None:
                out = self._templates.run(i, self.qlora.layers[i], hidden, *call)
            if out is None:
                with torch.no_grad():
                    out = original(*args, **kwargs)
        if i == blk.stop - 1:
            self.streamer.release(blk.index)
        if i == len(self.block_of) - 1:
            hs = out[0] if isinstance(out, tuple) else out
            self._leaf = hs.detach().requires_grad_(True)
            out = (self._leaf, *out[1:]) if isinstance(out, tuple) else self._leaf
        return out

    def _forward_keeping_graph(self, i, original, hidden, rest, kwargs, kw_hidden):
        """Layer i's forward with autograd from an input leaf, saved tensors packed to the host;
        the next layer gets the output detached (every layer's backward stays separate)."""
        x = hidden.detach().requires_grad_(True)
        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        with torch.enable_grad(), self.offloader.hooks(i, protect=(x,)):
            out = original(*rest, hidden_states=x, **kw) if kw_hidden else original(x, *rest, **kw)
        h = out[0] if isinstance(out, tuple) else out
        self._graphs[i] = (x, h)
        return (h.detach(), *out[1:]) if isinstance(out, tuple) else h.detach()

    def _recompute(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's forward again, with autograd, from its saved input: (input leaf, output)."""
        x = self._inputs.pop(i).detach().requires_grad_(True)
        rest, kwargs, kw_hidden = self._calls.pop(i)
        layer = self.qlora.layers[i]
        out = layer(*rest, hidden_states=x, **kwargs) if kw_hidden else layer(x, *rest, **kwargs)
        return x, out[0] if isinstance(out, tuple) else out

    # --- the step -------------------------------------------------------------------------
    def forward_backward(self, batch):
        if self.offload_layers and not self.offloader.protected:  # never offload parameters or weight buffers
            self.offloader.protected = {p.untyped_storage().data_ptr() for p in self.model.parameters()} | {
                self.streamer.region.untyped_storage().data_ptr()}
        with sdpa_context(self.cfg.attention):
            self._mode = "stream"
            try:
                out = self.model(input_ids=batch.input_ids, labels=batch.labels, use_cache=False)
            finally:
                self._mode = "plain"
            loss = out.loss / self.cfg.grad_accum
            loss.backward()
            grad = self._leaf.grad
            self._leaf = self._head_dev = None
            self.streamer.release_head()
            for blk in reversed(self.blocks):
                grad = self._backward_block(blk, grad)
        return loss.detach()

    def _backward_block(self, blk: Block, grad: torch.Tensor) -> torch.Tensor:
        """Backpropagate `grad` through block `blk`, its layers last to first; returns the gradient
        at the block's input. Layer i-1's recompute is enqueued while layer i's backward is (on the
        worker thread, with `overlap_backward`); everything that orders the stream against the copy
        stream (acquire, release, the offloaded tensors' events) happens between the two, so no
        backward kernel waits on a copy it does not need."""
        self.streamer.acquire(blk.index)
        self.streamer.prefetch(blk.index - 1)
        if blk.index > 0:  # the next block's offloaded activations, queued behind its weights
            prev = self.blocks[blk.index - 1]
            for j in reversed(range(prev.first, prev.stop)):
                self.offloader.prefetch(j)
        pending = None
        for i in reversed(range(blk.first, blk.stop)):
            templated = self._templates is not None and i not in self._graphs
            if not templated:  # enqueued while layer i+1's backward is (overlap_backward)
                x, h = self._graphs.pop(i) if i in self._graphs else self._recompute(i)
            if pending is not None:
                grad, pending = pending.result(), None
                self.offloader.release(i + 1)
            if self.fault_refill_before_backward and i == blk.stop - 1:
                self._refill_wrong(blk)
            if templated:
                rest, kwargs, kw_hidden = self._calls[i]
                out = self._templates.run(i, self.qlora.layers[i], self._inputs[i], rest, kwargs, kw_hidden, grad)
                if out is not None:
                    del self._inputs[i], self._calls[i]
                    grad = out
                    continue
                x, h = self._recompute(i)  # this layer's template declined: eagerly
            self.offloader.acquire(i)  # no-op unless i kept its graph (tensors prefetched with its block)
            pending = self._submit_backward(h, grad, x)
        if pending is not None:
            grad = pending.result()
        self.offloader.release(blk.first)
        self.streamer.release(blk.index)
        return grad

    def _submit_backward(self, h: torch.Tensor, grad: torch.Tensor, x: torch.Tensor):
        """Layer backward from output `h` with incoming `grad`; `.result()` is the gradient at `x`."""

        def run() -> torch.Tensor:
            torch.autograd.backward(h, grad)
            return x.grad

        if self._worker is None:
            return _Done(run())
        return self._worker.submit(run)

    def _refill_wrong(self, blk) -> None:
        """Negative control: refill the block's buffer between its forward and backward.

        Mimics the real trap: the buffer then holds another block's (valid) NF4 bytes.
        """
        buf = self.streamer.buffers[self.streamer.slot(blk.index)]
        for j in (blk.index - 2, blk.index + 2, blk.index - 1, blk.index + 1):
            if 0 <= j < len(self.blocks) and self.blocks[j].nbytes >= blk.nbytes:
                src = self.blocks[j].start
                buf[: blk.nbytes].copy_(self.store.arena[src : src + blk.nbytes])
                break
        else:  # a single block: corrupt the packed weights only, keeping absmax finite
            first = self.store.layers[blk.first].slots[0]
            view = weight_view(buf, first, base=blk.start)
            view.copy_(view ^ 0x11)
        self.streamer.invalidate()

    def step(self, batches=None):
        self.streamer.reset_counters()
        self.offloader.reset_counters()
        return super().step(batches)

    def close(self) -> None:
        # the patched forwards close over self: drop them so nothing keeps the buffers alive
        for layer in self.qlora.layers:
            layer.__dict__.pop("forward", None)
        for m in (self.qlora.hf.get_input_embeddings(), self.qlora.hf.get_output_embeddings()):
            m.__dict__.pop("forward", None)
        self._inputs.clear()
        self._calls.clear()
        self._graphs.clear()
        self.offloader.clear()
        if self._templates is not None:
            self._templates.clear()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self._head_dev = self._leaf = None
        del self.streamer
        super().close()

    def use_layer_templates(self, capture: bool) -> None:
        """Run every recomputed layer's forward, and its recompute + backward, through layer templates
        (poros/graphs.py): replayed from CUDA graphs with `capture` (what `cuda_graphs: true` selects),
        eagerly without (CPU tests)."""
        self._templates = LayerTemplates(capture=capture)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def counters(self) -> dict:
        out = self.streamer.counters()
        if self._templates is not None:
            out.update(self._templates.counters())
        if self.offload_layers:
            out.update(offloaded_layers=len(self.offload_layers), act_bytes_d2h=self.offloader.bytes_d2h,
                       act_bytes_h2d=self.offloader.bytes_h2d)
        return out
