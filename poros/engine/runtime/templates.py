"""The layer templates a poros trainer runs (`LayerTemplates`): recomputing templates by layer key
(poros/engine/runtime/graphs.py says how a template replays a layer's kernels from a CUDA graph), and a kept layer's
template (`KeptTemplate`), which holds its forward's activations until its backward.
"""

from __future__ import annotations

import torch
from torch import nn

from poros.engine.runtime.graphs import LayerRefs, LayerTemplate, Statics, templatable, tensors_in
from poros.engine.runtime.layer_call import LayerCall


class KeptTemplate(LayerTemplate):
    """One kept layer's forward with autograd and, later, its backward from the activations that forward
    kept: two graphs (`forward`, `backward`) where a recomputing template has one, so a kept layer costs
    two launches instead of hundreds and no recompute.

    Unlike a recomputing template it holds state from its forward to its backward: its input and
    arguments (which its autograd graph may save) are its own tensors, not the shared statics, and the
    activations its forward saves live in a memory pool that only kept templates use; the backward
    retains the autograd graph, so those activations stay allocated and no later capture is handed their
    memory. One template per (layer, micro-batch) whose activations are kept at once. Its output and the
    gradient at its input still go through the shared statics, copied out right after each replay.
    Without capture (`capture=False`) both halves run eagerly, with a new autograd graph every forward.
    """

    def __init__(self, layer: nn.Module, capture: bool, pool=None, statics: Statics | None = None,
                 compiled: bool = False):
        super().__init__(layer, capture, pool, backward=True, statics=statics, compiled=compiled)
        self.phase = "forward"
        self.graphs: dict[str, object] = {}
        self.out_h: torch.Tensor | None = None  # the forward's output, its autograd graph kept for backward
        self.static_out = None

    # --- the two halves -----------------------------------------------------------------------
    def forward(self, layer: "LayerRefs", x: torch.Tensor, call: LayerCall):
        """The layer's output, its activations kept in this template; None when this template cannot
        serve this call (the caller runs the layer eagerly, as it would without templates)."""
        if not self._prepare(layer, x, call, None):
            return None
        self._run("forward")
        if not self.usable:
            return None
        h = self.static_out.clone()
        return h if self.out_rest is None else (h, *self.out_rest)

    def backward_from_kept(self, layer: "LayerRefs", grad: torch.Tensor) -> torch.Tensor:
        """The gradient at the layer's input from the incoming `grad`, LoRA gradients accumulated into
        `layer`'s parameters. A backward capture that fails runs the same backward eagerly, and the layer
        runs without its template from its next forward on."""
        with torch.no_grad():
            self.static_grad.copy_(grad)
        self._run("backward")
        out = self.static_dx.clone()
        self._accumulate(layer.lora)
        if not self.capture or self.graphs.get("backward") is None:
            self._clear_grads()
        self.replays += 1
        return out

    def _run(self, phase: str) -> None:
        self.phase = phase
        if not self.capture:
            self._body()
            return
        if phase not in self.graphs:
            self._clear_grads()
            self.graphs[phase] = self._captured("kept layer")
            if self.graphs[phase] is None and phase == "forward":  # nothing kept: the layer runs without templates
                self.usable = False
                return
        if self.graphs[phase] is None:  # the backward of a captured forward, eagerly, this once
            self._clear_grads()
            self.static_x.grad = None  # nothing a failed capture left behind is added to
            self._body()
            # The forward's autograd graph saved the template's own input and arguments at the versions of
            # its capture. Every later call copies into them (a version each) and a replay refills its
            # activations unseen by autograd, so an eager backward of a replayed forward would raise or
            # read activations it cannot check: from the next call on the layer runs without its template.
            self.usable = False
            self.out_h = None
        else:
            self.graphs[phase].replay()

    def _body(self) -> None:
        if self.phase == "forward":
            with torch.enable_grad():
                out = self._call()
            if isinstance(out, tuple):
                if any(torch.is_tensor(o) for o in tensors_in(out[1:], [])):
                    self.usable = False
                    return
                out, self.out_rest = out[0], tuple(out[1:])
            self.out_h = out
            with torch.no_grad():
                self._put(self.static_out, out)
            return
        # retained under capture: the next replays of the forward refill these activations in place
        torch.autograd.backward(self.out_h, self.static_grad, retain_graph=self.capture)
        with torch.no_grad():
            self._put(self.static_dx, self.static_x.grad)
        self.static_x.grad = None
        if not self.capture:
            self.out_h = None

    def _setup(self, x, tensors, grad, skeleton) -> None:
        self.skeleton = skeleton
        own = lambda t: torch.empty_like(t, requires_grad=False, memory_format=torch.contiguous_format)  # noqa: E731
        self.static_x = own(x).requires_grad_(True)
        self.static_args = [own(t) for t in tensors]
        self.static_out = self.statics.get("output", x)
        self.static_grad = self.statics.get("grad_output", x)
        self.static_dx = self.statics.get("grad_input", x)

    @property
    def captured(self) -> bool:  # both halves
        return self.graphs.get("forward") is not None and self.graphs.get("backward") is not None

    @property
    def nbytes_own(self) -> int:
        """The activation-sized tensors this template keeps for itself (input and arguments)."""
        return sum(t.numel() * t.element_size() for t in [self.static_x, *self.static_args] if t is not None)


class LayerTemplates:
    """Templates by `layer_key`, created on first use; counters for the engine's report.

    All graphs share one memory pool and one set of static tensors (`Statics`). That is safe because
    replays never overlap: a template's only pool-resident outputs (its LoRA gradients) are consumed
    right after its replay, and its result is copied out of the static tensors before another template
    runs; its inputs (the static tensors and its own parameters) live outside the pool.
    """

    def __init__(self, capture: bool, compiled: bool = False):
        self.capture, self.compiled = capture, compiled
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.kept_pool = torch.cuda.graph_pool_handle() if capture else None  # kept templates' alone
        self.statics = Statics()
        self.templates: dict[tuple, LayerTemplate] = {}  # by (backward?, layer key)
        self.kept: dict[tuple[int, int], KeptTemplate] = {}  # by (layer, micro-batch)
        self.refs: dict[int, LayerRefs] = {}
        self.fallbacks = 0

    def _refs(self, i: int, layer: nn.Module) -> "LayerRefs | None":
        if i not in self.refs:
            self.refs[i] = LayerRefs(layer) if templatable(layer) else None
        return self.refs[i]

    def kept_forward(self, i: int, m: int, layer: nn.Module, x, call: LayerCall):
        """Kept layer i's forward for micro-batch m through its own template, its activations kept
        there for `kept_backward`; None: run it eagerly instead (and its backward from its own graph)."""
        refs = self._refs(i, layer)
        if refs is None:
            self.fallbacks += 1
            return None
        tpl = self.kept.get((i, m))
        if tpl is None:
            tpl = self.kept[(i, m)] = KeptTemplate(layer, self.capture, self.kept_pool, statics=self.statics,
                                                   compiled=self.compiled)
        out = tpl.forward(refs, x, call)
        if out is None:
            self.fallbacks += 1
        return out

    def kept_backward(self, i: int, m: int, grad: torch.Tensor) -> torch.Tensor:
        """The gradient at kept layer i's input for micro-batch m, from the activations its template's
        forward kept; LoRA gradients accumulated into the layer's parameters."""
        return self.kept[(i, m)].backward_from_kept(self.refs[i], grad)

    def run(self, i: int, layer: nn.Module, x, call: LayerCall, grad=None):
        """Layer i through its template: with `grad`, recompute + backward (returns the gradient at
        `x`); without, the forward without autograd (returns the layer's output). None: run it
        eagerly instead."""
        refs = self._refs(i, layer)
        if refs is None:
            self.fallbacks += 1
            return None
        key = (grad is not None, refs.key)
        tpl = self.templates.get(key)
        if tpl is None:
            tpl = self.templates[key] = LayerTemplate(layer, self.capture, self.pool, backward=grad is not None,
                                                      statics=self.statics, compiled=self.compiled)
        out = tpl.run(refs, x, call, grad)
        if out is None:
            self.fallbacks += 1
        return out

    def _all(self) -> list[LayerTemplate]:
        return [*self.templates.values(), *self.kept.values()]

    def counters(self) -> dict:
        return {"layer_templates": sum(k[0] for k in self.templates),
                "forward_templates": sum(not k[0] for k in self.templates), "kept_templates": len(self.kept),
                "template_fallbacks": self.fallbacks,
                "graphs_captured": sum(t.captured for t in self._all()),
                "capture_errors": sum(t.error is not None for t in self._all()),
                "template_static_bytes": self.statics.nbytes + sum(t.nbytes_own for t in self.kept.values())}

    def errors(self) -> list[str]:
        return sorted({t.error for t in self._all() if t.error})

    def clear(self) -> None:
        self.templates.clear()
        self.kept.clear()
        self.refs.clear()
        self.statics = Statics()
