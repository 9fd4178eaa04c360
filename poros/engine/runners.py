"""Layer runners: how one kind of decoder layer runs its forward and its backward for the executor.

  Recompute       forward without autograd, its input saved (`SavedInputs`); backward recomputes the
                  forward from that input with autograd, then backpropagates (one layer's activations
                  on the device at a time). Given a worker thread (`overlap_backward`) the backward is
                  enqueued there, while the executor's thread enqueues the next layer's recompute.
  Kept            resident QLoRA's forward, with autograd, its activations kept until its backward
                  (`keep_activations`: no recompute).
  TemplateRecompute, TemplateKept
                  the same through layer templates (poros/engine/graphs.py), replayed from CUDA graphs
                  under capture; a call a template declines runs as the eager runner runs it.

Every runner keys its state by (layer, micro-batch). `backward` takes `grad`, a function giving the
gradient at the layer's output (it waits for the backward before this one), and returns a pending
result whose `result()` is the gradient at the layer's input.
"""

from __future__ import annotations

import abc
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn

from poros.engine.buffers import SavedInputs
from poros.engine.graphs import LayerTemplates
from poros.engine.layer_call import LayerCall, hidden_of

Key = tuple[int, int]  # (layer, micro-batch)


class Done:
    """An already computed gradient with a future's `result()` (a serial backward, a template's)."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def result(self) -> torch.Tensor:
        return self.value


class Runner(abc.ABC):
    """The common interface: `forward` returns the layer's output hidden state, `backward` a pending
    gradient at its input; `len` counts the (layer, micro-batch) states held between the two."""

    def __init__(self, layers: nn.ModuleList, worker: ThreadPoolExecutor | None):
        self.layers, self.worker = layers, worker

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
    def __init__(self, layers, worker, saved: SavedInputs):
        super().__init__(layers, worker)
        self.saved = saved
        self.calls: dict[Key, LayerCall] = {}

    def forward(self, key, x, call):
        self.saved.put(key, x)
        self.calls[key] = call
        return self._forward(key, x, call)

    def _forward(self, key, x, call):
        with torch.no_grad():
            return hidden_of(call(self.layers[key[0]], x))

    def recompute(self, key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's forward again, with autograd, from its saved input: (input leaf, output)."""
        x = self.saved.take(key).detach().requires_grad_(True)
        return x, hidden_of(self.calls.pop(key)(self.layers[key[0]], x))

    def backward(self, key, grad):
        x, h = self.recompute(key)  # enqueued while the backward in flight runs (overlap_backward)
        return self._backpropagate(x, h, grad())

    def __len__(self) -> int:
        return len(self.calls)

    def clear(self) -> None:
        self.calls.clear()


class TemplateRecompute(Recompute):
    def __init__(self, layers, worker, saved, templates: LayerTemplates):
        super().__init__(layers, worker, saved)
        self.templates = templates

    def _forward(self, key, x, call):
        out = self.templates.run(key[0], self.layers[key[0]], x, call)
        return super()._forward(key, x, call) if out is None else hidden_of(out)

    def backward(self, key, grad):
        g = grad()
        out = self.templates.run(key[0], self.layers[key[0]], self.saved.peek(key), self.calls[key], g)
        if out is not None:
            self.saved.take(key)
            del self.calls[key]
            return Done(out)
        x, h = self.recompute(key)  # this layer's template declined: eagerly
        return self._backpropagate(x, h, g)


class Kept(Runner):
    def __init__(self, layers, worker):
        super().__init__(layers, worker)
        self.kept: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}  # (input leaf, output)

    def forward(self, key, x, call):
        leaf = x.detach().requires_grad_(True)
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

    def __init__(self, layers, worker, templates: LayerTemplates):
        super().__init__(layers, worker)
        self.templates = templates
        self.in_template: set[Key] = set()

    def forward(self, key, x, call):
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
