"""Layer templates: one decoder layer's recompute + backward (and its forward without autograd),
replayed from a CUDA graph (`LayerTemplate`). The templates a trainer holds, and a kept layer's, are in
poros/engine/runtime/templates.py.

At seq 512 poros's backward is bound by host-side launch work (hundreds of small kernels per layer
through bitsandbytes, peft and transformers), not by the GPU. A CUDA graph replays a captured
kernel sequence for one launch, but it replays fixed addresses. Two layers can share a graph when
their NF4 weights sit at the same addresses (the same block buffer at the same offset: block b
and b+2 alternate between the two buffers) and their modules are alike; everything else a layer
owns (LoRA A/B, norm weights, buffers) is copied into the template's own tensors before a replay,
and the template's LoRA gradients are accumulated into the layer's afterwards. So the number of
graphs is (buffers x layers per block x layer kinds), not the number of layers, and their
activations share one memory pool (replays never overlap).

The tensors a graph reads and writes at fixed addresses (the layer input, the incoming gradient,
the other arguments; the output or the gradient at the input) are shared by every template of the
same shape (`Statics`): a template copies its inputs in just before its replay and its result out
just after, inside the graph, so no template keeps activation-sized tensors of its own (at long context
one activation per template would add up to more than a streamed block).

The kernels are the ones eager recompute + backward launches, in the same order, on the same
data, so the result is bitwise the same; the parity gate checks that on the GPU. Without capture
(`capture=False`, the CPU tests) the template runs eagerly: the same copies in and out, which is
what the CPU gate verifies.

Compiled layers (`compile`): a template compiles its own copy (`layer.compile()`, as resident does), its
forward runs the training graph (with autograd, dropped, as poros's eager runners do: poros/engine/runtime/runners.py),
and it runs at least one warm-up call before its capture, so dynamo and inductor compile outside the capture
and the graph records only the compiled kernels; a replay never re-enters Python, so no guard runs then
(a template's tensors, shapes and arguments are fixed, which is what the guards would check). A layer whose
input requires no gradient (the first) is not templated under `compile`: its graph differs from the others'.
"""

from __future__ import annotations

import copy
import os
import warnings

import torch
from torch import nn

from poros.engine.model.compiling import compile_module
from poros.engine.runtime.layer_call import LayerCall, hidden_of
from poros.errors import PorosError

# Eager runs on a side stream before each capture, as PyTorch's examples do. They leave activations
# allocated for good (experiments/h200-cuda-graph-memory) and capture succeeds without them, so none by
# default. The environment variable is for probes, not a setting.
WARMUP_ENV = "POROS_GRAPH_WARMUP"


def graph_warmup() -> int:
    """Eager calls before each capture: POROS_GRAPH_WARMUP, 0 where unset.

    Raises:
        PorosError: naming the variable, what it takes and what it holds.
    """
    text = os.environ.get(WARMUP_ENV, "").strip() or "0"
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise PorosError(f"{WARMUP_ENV}: expected a whole number >= 0 of eager calls before each CUDA graph capture, "
                         f"got {text!r}; unset it for none")
    return n

COMPILED_WARMUP = 1  # compiled layers: calls before a capture, so that dynamo and inductor compile outside it
IGNORED_ATTRS = {"layer_idx", "training"}  # per-layer attributes that do not change the kernels


def tensors_in(obj, out: list) -> list:
    """Tensors inside nested tuples/lists/dicts, in a fixed order."""
    if torch.is_tensor(obj):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            tensors_in(v, out)
    elif isinstance(obj, dict):
        for k in sorted(obj):
            tensors_in(obj[k], out)
    return out


def _skeleton(obj):
    """The non-tensor part of nested arguments (tensors replaced by their shape and dtype)."""
    if torch.is_tensor(obj):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.device.type)
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(_skeleton(v) for v in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((k, _skeleton(obj[k])) for k in sorted(obj)))
    # other objects (e.g. gemma4's KVSharingDict, new every forward) pass through as they are: a layer
    # that reads or writes one is never templated (see `templatable`)
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else ("object", type(obj).__name__)


def _rebuild(obj, it):
    """`obj` with its tensors replaced, in `_tensors` order, by the ones `it` yields."""
    if torch.is_tensor(obj):
        return next(it)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rebuild(v, it) for v in obj)
    if isinstance(obj, dict):
        rebuilt = {k: _rebuild(obj[k], it) for k in sorted(obj)}
        return {k: rebuilt[k] for k in obj}
    return obj


def nf4_params(layer: nn.Module) -> list[torch.Tensor]:
    import bitsandbytes as bnb

    return [p for p in layer.parameters() if isinstance(p, bnb.nn.Params4bit)]


# module attributes that make a layer read state another layer left in its arguments (gemma4's KV
# sharing). A layer that only stores its K/V there ("store" mode) is fine: the engine refuses models
# with readers (PorosTrainer), so what it stores is never read.
CROSS_LAYER_ATTRS = ("is_kv_shared_layer",)


def templatable(layer: nn.Module) -> bool:
    """A layer whose result depends only on its tensors and arguments (no cross-layer state)."""
    return not any(getattr(m, a, False) is True for m in layer.modules() for a in CROSS_LAYER_ATTRS)


def layer_key(layer: nn.Module) -> tuple:
    """Layers with equal keys can share a template: the same NF4 addresses and the same modules."""
    addrs = []
    for p in nf4_params(layer):
        addrs.append((p.data_ptr(), tuple(p.shape), p.quant_state.absmax.data_ptr(), tuple(p.quant_state.shape)))
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    attrs = []
    for name, m in layer.named_modules():
        for k, v in sorted(vars(m).items()):
            if k.startswith("_") or k in IGNORED_ATTRS:
                continue
            if isinstance(v, (int, float, str, bool, type(None))) or (
                    isinstance(v, (tuple, list)) and all(isinstance(x, (int, float, str, bool)) for x in v)):
                attrs.append((name, k, tuple(v) if isinstance(v, list) else v))
    return (type(layer).__name__, tuple(addrs), params, buffers, tuple(attrs))


class Statics:
    """The fixed-address tensors of every template, one per (role, shape, dtype): replays never overlap,
    and each template fills what it reads right before its replay and copies what it writes right after
    it, so sharing them is safe. Allocated outside any graph's pool."""

    def __init__(self):
        self.tensors: dict[tuple, torch.Tensor] = {}
        self._warmup_stream = None

    @property
    def warmup_stream(self) -> "torch.cuda.Stream":
        """The side stream every template's calls before its capture run on, one for all of them. The caching
        allocator keeps what a stream frees for that stream alone: on a stream of its own, each capture's warm-up
        (a layer's recompute and backward, compiled or not) would leave its bytes reserved where no later
        allocation reads them; on one, each warm-up reuses the last one's."""
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream()
        return self._warmup_stream

    def get(self, role, like: torch.Tensor) -> torch.Tensor:
        key = (role, tuple(like.shape), like.dtype, like.device)
        if key not in self.tensors:
            self.tensors[key] = torch.empty_like(like, requires_grad=False, memory_format=torch.contiguous_format)
        return self.tensors[key]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def copy_groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The indices of `tensors` grouped by dtype, in first-seen order. torch's foreach copy takes its one-launch
    path on CUDA only over tensors of one dtype and copies one tensor at a time otherwise: a layer template's
    tensors (fp32 LoRA weights, bf16 activations, the call's other arguments) copied as one list cost a copy and
    its host-side dispatch per tensor at every replay, as groups one launch per dtype. The same bytes either way."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


class LayerTemplate:
    """A private copy of one layer sharing only its NF4 weights. With `backward`, runs (or replays)
    the layer's recompute + backward; without, its forward without autograd."""

    def __init__(self, layer: nn.Module, capture: bool, pool=None, backward: bool = True,
                 statics: Statics | None = None, compiled: bool = False):
        shared = {}
        for p in nf4_params(layer):
            shared[id(p)] = p
            shared[id(p.quant_state)] = p.quant_state
        for m in layer.modules():
            if getattr(m, "quant_state", None) is not None:
                shared[id(m.quant_state)] = m.quant_state
        self.module = copy.deepcopy(layer, shared)
        self.module.__dict__.pop("forward", None)  # the streaming engine's patched forward stays on the original
        self.module._compiled_call_impl = None  # a compiled original's call, copied as is, would run the original
        self.compiled = compiled
        if compiled:
            compile_module(self.module)
        self.nf4 = {id(p) for p in nf4_params(layer)}
        self.capture, self.pool, self.backward = capture, pool, backward
        self.statics = statics or Statics()
        self.graph = None
        self.params = [p for p in self.module.parameters() if id(p) not in self.nf4]
        self.lora = [p for p in self.params if p.requires_grad]
        self.buffers = list(self.module.buffers())
        self.static_x = self.static_grad = self.static_out = self.static_dx = None
        self.out_rest = None  # forward: what follows the hidden state when the layer returns a tuple
        self.static_args: list[torch.Tensor] = []
        self.call: LayerCall | None = None  # the call's arguments over the static tensors
        self.skeleton = None
        self.usable = True
        self.error: str | None = None  # why capture failed, if it did
        self._dst = None
        self._groups: list[list[int]] = []  # `_dst`'s indices by dtype (`copy_groups`)
        self._dst_groups: list[list[torch.Tensor]] = []  # and their tensors
        self.replays = 0

    # --- one call -----------------------------------------------------------------------------
    def run(self, layer: "LayerRefs", x: torch.Tensor, call: LayerCall, grad: torch.Tensor | None = None):
        """Backward template: layer `layer`'s recompute from input `x` and backward of `grad`, LoRA
        grads accumulated into `layer`'s parameters; returns the gradient at `x`. Forward template:
        returns the layer's output. None when this call's non-tensor arguments differ from the
        captured ones, or the layer's output is not a template's to give (the caller runs it eagerly)."""
        if not self._prepare(layer, x, call, grad):
            return None
        if self.capture:
            if self.graph is None:
                self.graph = self._captured("layer")
                if self.graph is None:  # not capturable here: this template runs eagerly from now on
                    self.usable = False
                    self._clear_grads()
                if not self.usable:
                    return None
            self.graph.replay()
        else:
            self._body()
            if not self.usable:
                return None
        self.replays += 1
        if not self.backward:
            h = self.static_out.clone()
            return h if self.out_rest is None else (h, *self.out_rest)
        out = self.static_dx.clone()
        self._accumulate(layer.lora)
        if not self.capture:  # eager: the next run must not accumulate onto this one
            self._clear_grads()
        return out

    def _prepare(self, layer: "LayerRefs", x, call: LayerCall, grad) -> bool:
        """This call's tensors copied into the template's static ones (set up on the first call); False
        when its non-tensor arguments differ from the first call's, or the template is unusable."""
        skeleton = (_skeleton(call.args), _skeleton(call.kwargs), call.kw_hidden, tuple(x.shape), x.dtype)
        tensors = tensors_in((call.args, call.kwargs), [])
        if self.skeleton is None:
            self._setup(x, tensors, grad, skeleton)
        elif skeleton != self.skeleton or not self.usable:
            return False
        self._load(layer, x, tensors, grad)
        it = iter(self.static_args)
        self.call = LayerCall(_rebuild(call.args, it), _rebuild(call.kwargs, it), call.kw_hidden)
        return True

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _captured(self, what: str):
        """`_body` captured into a CUDA graph, or None when it cannot be here (the error recorded and
        warned about; the caller runs `what` eagerly)."""
        try:
            return self._capture()
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"[:300]
            warnings.warn(f"poros: CUDA graph capture failed, running the {what} eagerly: {self.error}",
                          stacklevel=3)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return None

    def _accumulate(self, params: list[torch.Tensor]) -> None:
        """The template's LoRA gradients into `params`' .grad, as autograd's AccumulateGrad would:
        the first gradient becomes .grad (a copy here: the template's is overwritten by the next
        replay), later ones are added in place. One foreach launch each, not one per tensor."""
        new = [(p, t.grad) for p, t in zip(params, self.lora, strict=True) if p.grad is None]
        old = [(p, t.grad) for p, t in zip(params, self.lora, strict=True) if p.grad is not None]
        if new:
            copies = [torch.empty_like(g) for _, g in new]
            torch._foreach_copy_(copies, [g for _, g in new])
            for (p, _), c in zip(new, copies):
                p.grad = c
        if old:
            torch._foreach_add_([p.grad for p, _ in old], [g for _, g in old])

    def _setup(self, x, tensors, grad, skeleton) -> None:
        self.skeleton = skeleton
        # a leaf of its own (its own .grad) over the shared input's memory; a compiled forward's requires grad,
        # as in resident's training graph
        self.static_x = self.statics.get("input", x).detach().requires_grad_(self.backward or self.compiled)
        self.static_grad = self.statics.get("grad_output", grad) if self.backward else None
        self.static_args = [self.statics.get(("arg", k), t) for k, t in enumerate(tensors)]
        if self.backward:
            self.static_dx = self.statics.get("grad_input", x)
        else:
            self.static_out = self.statics.get("output", x)

    def _load(self, layer: "LayerRefs", x, tensors, grad) -> None:
        if self._dst is None:
            self._dst = [p.detach() for p in self.params] + self.buffers + [self.static_x.detach()]
            self._dst += ([self.static_grad] if grad is not None else []) + self.static_args
            self._groups = copy_groups(self._dst)
            self._dst_groups = [[self._dst[i] for i in g] for g in self._groups]
        src = layer.state + [x.detach()] + ([grad] if grad is not None else []) + tensors
        with torch.no_grad():
            for group, dst in zip(self._groups, self._dst_groups):
                torch._foreach_copy_(dst, [src[i] for i in group])

    def _call(self):
        return self.call(self.module, self.static_x)

    def _body(self) -> None:
        """The layer's work and the copy of its result into the shared static tensor (both captured)."""
        if self.backward:
            with torch.enable_grad():
                out = self._call()
                torch.autograd.backward(hidden_of(out), self.static_grad)
            with torch.no_grad():
                self._put(self.static_dx, self.static_x.grad)
            self.static_x.grad = None  # the graph's own gradient buffer is free for the next capture
            return
        with torch.enable_grad() if self.compiled else torch.no_grad():  # compiled: the training graph, dropped
            out = self._call()
        if isinstance(out, tuple):
            if any(torch.is_tensor(o) for o in tensors_in(out[1:], [])):
                self.usable = False  # more than a hidden state comes back: not replayable as one
                return
            out, self.out_rest = out[0], tuple(out[1:])
        with torch.no_grad():
            self._put(self.static_out, out)

    def _put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.shape != dst.shape or src.dtype != dst.dtype:
            self.usable = False  # a result unlike the input: not one the shared tensors can hold
            return
        dst.copy_(src)

    def _clear_grads(self) -> None:
        if self.backward:
            for p in self.lora:
                p.grad = None

    def _capture(self) -> None:
        side = self.statics.warmup_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(graph_warmup(), COMPILED_WARMUP if self.compiled else 0)):
                self._body()
                self._clear_grads()
        torch.cuda.current_stream().wait_stream(side)
        if not self.usable:
            return None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._body()
        return graph


class LayerRefs:
    """What a template copies from one layer (its tensors other than NF4, in template order) and
    the LoRA parameters its gradients go to; the layer's key. Gathered once per layer."""

    def __init__(self, layer: nn.Module):
        nf4 = {id(p) for p in nf4_params(layer)}
        params = [p for p in layer.parameters() if id(p) not in nf4]
        self.state = [p.detach() for p in params] + list(layer.buffers())
        self.lora = [p for p in params if p.requires_grad]
        self.key = layer_key(layer)
