"""Layer runners: how one kind of decoder layer runs its forward and its backward for the executor.

  Recompute       forward without autograd, its input saved (`SavedInputs`); backward recomputes the
                  forward from that input with autograd, then backpropagates (one layer's activations
                  on the device at a time). Given a worker thread (`overlap_backward`) the backward is
                  enqueued there, while the executor's thread enqueues the next layer's recompute. With
                  `keep_attention` the forward's attention results are saved with the input and the
                  recompute takes them instead of running attention's forward again
                  (poros/engine/model/kept_attention.py). A layer whose input the plan regenerates
                  (`input_stride`) saves none; `regenerate` runs a layer's forward again, the very call the
                  forward pass made, from its input: the next layer's input, bit for bit.
  Kept            resident QLoRA's forward, with autograd, its activations kept until its backward
                  (`keep_activations`: no recompute).
  TemplateRecompute, TemplateKept
                  the same through layer templates (poros/engine/runtime/graphs.py), replayed from CUDA graphs
                  under capture; a call a template declines runs as the eager runner runs it.

With compiled layers (`compile`) a layer's first forward runs the graph resident's forward runs: inductor
compiles a layer called with autograd (its training graph) into other kernels than one called without (its
inference graph), with other bits, so the Recompute forward runs with autograd and drops what it kept; and a
layer's input requires grad exactly where resident's does (not the first layer's, which the frozen embeddings
feed), as the graph also depends on that.

Every runner keys its state by (layer, micro-batch). `backward` takes `grad`, a function giving the
gradient at the layer's output (it waits for the backward before this one), and returns a pending
result whose `result()` is the gradient at the layer's input.
"""

from __future__ import annotations

import abc
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn

from poros.engine.model import kept_attention, mlp_chunk
from poros.engine.runtime.saved_inputs import SavedInputs
from poros.engine.runtime.templates import LayerTemplates
from poros.engine.runtime.layer_call import LayerCall, hidden_of

Key = tuple[int, int]  # (layer, micro-batch)


class Done:
    """An already computed gradient with a future's `result()` (a serial backward, a template's)."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def result(self) -> torch.Tensor:
        return self.value


class Runner(abc.ABC):
    """The common interface: `forward` returns the layer's output hidden state, `backward` a pending
    gradient at its input; `len` counts the (layer, micro-batch) states held between the two.

    Args:
        compiled: the layers are compiled (`compile`): forwards run resident's graph (see above).
    """

    def __init__(self, layers: nn.ModuleList, worker: ThreadPoolExecutor | None, compiled: bool = False):
        self.layers, self.worker, self.compiled = layers, worker, compiled

    def input_grad(self, key: Key, x: torch.Tensor) -> bool:
        """Whether layer key[0]'s input is a leaf requiring grad, as in resident's graph where that matters
        (compiled): there every layer after the first takes the output of a layer with LoRA parameters, and
        the first its embeddings' output, which requires grad only if they train. Eager layers compute the
        same bits either way and keep the gradient at every input."""
        return not self.compiled or key[0] > 0 or x.requires_grad

    @abc.abstractmethod
    def forward(self, key: Key, x: torch.Tensor, call: LayerCall) -> torch.Tensor:
        """Layer key[0]'s output for micro-batch key[1] from its input `x`."""

    @abc.abstractmethod
    def backward(self, key: Key, grad: Callable[[], torch.Tensor]):
        """The pending gradient at the layer's input; LoRA gradients accumulated as autograd does."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def clear(self) -> None:
        """Drop every state held (a trainer closing mid-step)."""

    def _backpropagate(self, x: torch.Tensor, h: torch.Tensor, grad: torch.Tensor):
        """Backward from `h` (output) to `x` (input leaf): on the worker thread, else now."""

        def run() -> torch.Tensor:
            torch.autograd.backward(h, grad)
            return x.grad

        return Done(run()) if self.worker is None else self.worker.submit(run)


class Recompute(Runner):
    """Args:
        keep_attention: save the forward's attention results with the input; the recompute takes them
            (while `kept_attention.installed()` is entered).
        eager_mlp: the layers' MLPs run eager (eager layers, or compiled ones without `compile_mlp`), so the
            recompute may leave a chunked MLP's output to its backward (`mlp_chunk.output_only_backpropagated`).
    """

    def __init__(self, layers, worker, saved: SavedInputs, compiled: bool = False, keep_attention: bool = False,
                 regenerated: frozenset[int] = frozenset(), eager_mlp: bool | None = None):
        super().__init__(layers, worker, compiled)
        self.saved, self.keep_attention, self.regenerated = saved, keep_attention, regenerated
        self.eager_mlp = not compiled if eager_mlp is None else eager_mlp
        self.calls: dict[Key, tuple[LayerCall, bool]] = {}  # the call and whether its input requires grad
        self.attention: dict[Key, kept_attention.AttentionRecord] = {}  # keep_attention: the forward's calls
        self.attention_calls = {"replayed": 0, "computed": 0}  # keep_attention: fused attention calls in recomputes

    def forward(self, key, x, call):
        self.calls[key] = (call, self.input_grad(key, x))
        if not self.keep_attention:
            if key[0] not in self.regenerated:
                self.saved.put(key, x)
            return self._forward(key, x, call)
        with kept_attention.recording() as record:
            out = self._forward(key, x, call)
        self.saved.put(key, x, *record.large())
        self.attention[key] = record.with_large(())  # the large tensors are the saved ones
        return out

    def _forward(self, key, x, call):
        if not self.compiled:
            with torch.no_grad():
                return hidden_of(call(self.layers[key[0]], x))
        with torch.enable_grad():  # the training graph (module docstring); its saved activations dropped here
            leaf = x.detach().requires_grad_(self.calls[key][1])
            return hidden_of(call(self.layers[key[0]], leaf)).detach()

    def regenerate(self, key: Key) -> torch.Tensor:
        """Layer key[0]'s output for micro-batch key[1] again, as its forward made it: the same call on the same
        input (saved, or regenerated itself), which stays where it is for the layer's own backward."""
        return self._forward(key, self.saved.peek(key)[0], self.calls[key][0])

    def recompute(self, key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's forward again, with autograd, from its saved input: (input leaf, output). The output is
        only backpropagated, so an eager MLP (an eager layer's, or a compiled layer's without `compile_mlp`) that
        is chunked computes its own part in the backward alone (`mlp_chunk.output_only_backpropagated`); a
        compiled MLP runs in the graph resident's forward runs."""
        call, wants = self.calls.pop(key)
        x, *large = self.saved.take(key)
        x = x.detach().requires_grad_(wants)
        deferred = mlp_chunk.output_only_backpropagated() if self.eager_mlp else contextlib.nullcontext()
        if key not in self.attention:
            with deferred:
                return x, hidden_of(call(self.layers[key[0]], x))
        with kept_attention.replaying(self.attention.pop(key).with_large(large)) as counts, deferred:
            out = hidden_of(call(self.layers[key[0]], x))
        for k, v in counts.items():
            self.attention_calls[k] += v
        return x, out

    def backward(self, key, grad):
        x, h = self.recompute(key)  # enqueued while the backward in flight runs (overlap_backward)
        return self._backpropagate(x, h, grad())

    def __len__(self) -> int:
        return len(self.calls)

    def clear(self) -> None:
        self.calls.clear()
        self.attention.clear()


class TemplateRecompute(Recompute):
    def __init__(self, layers, worker, saved, templates: LayerTemplates, compiled: bool = False):
        super().__init__(layers, worker, saved, compiled)
        self.templates = templates

    def _forward(self, key, x, call):
        if not self.calls[key][1]:  # compiled, its input without a gradient: not templated (graphs.py)
            return super()._forward(key, x, call)
        out = self.templates.run(key[0], self.layers[key[0]], x, call)
        return super()._forward(key, x, call) if out is None else hidden_of(out)

    def backward(self, key, grad):
        g = grad()
        if not self.calls[key][1]:
            x, h = self.recompute(key)
            return self._backpropagate(x, h, g)
        out = self.templates.run(key[0], self.layers[key[0]], self.saved.peek(key)[0], self.calls[key][0], g)
        if out is not None:
            self.saved.take(key)
            del self.calls[key]
            return Done(out)
        x, h = self.recompute(key)  # this layer's template declined: eagerly
        return self._backpropagate(x, h, g)


class Kept(Runner):
    def __init__(self, layers, worker, compiled: bool = False):
        super().__init__(layers, worker, compiled)
        self.kept: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}  # (input leaf, output)

    def forward(self, key, x, call):
        leaf = x.detach().requires_grad_(self.input_grad(key, x))
        with torch.enable_grad():
            h = hidden_of(call(self.layers[key[0]], leaf))
        self.kept[key] = (leaf, h)
        return h.detach()

    def backward(self, key, grad):
        x, h = self.kept.pop(key)  # the forward's own activations: nothing to recompute
        return self._backpropagate(x, h, grad())

    def __len__(self) -> int:
        return len(self.kept)

    def clear(self) -> None:
        self.kept.clear()


class TemplateKept(Kept):
    """A kept layer in its own template per micro-batch (two graphs: forward and backward), which holds
    its activations; a forward the template declines runs eagerly and keeps them here."""

    def __init__(self, layers, worker, templates: LayerTemplates, compiled: bool = False):
        super().__init__(layers, worker, compiled)
        self.templates = templates
        self.in_template: set[Key] = set()

    def forward(self, key, x, call):
        if not self.input_grad(key, x):  # compiled, its input without a gradient: not templated (graphs.py)
            return super().forward(key, x, call)
        out = self.templates.kept_forward(*key, self.layers[key[0]], x, call)
        if out is None:
            return super().forward(key, x, call)
        self.in_template.add(key)
        return hidden_of(out)

    def backward(self, key, grad):
        if key not in self.in_template:
            return super().backward(key, grad)
        self.in_template.discard(key)
        return Done(self.templates.kept_backward(*key, grad()))

    def __len__(self) -> int:
        return super().__len__() + len(self.in_template)

    def clear(self) -> None:
        super().clear()
        self.in_template.clear()
