"""Regional compilation (`compile`): every decoder layer `layer.compile()`d, for every method alike.

Inductor partitions a compiled layer's training graph into a forward and a backward and chooses which
intermediates the forward saves. bitsandbytes' 4-bit matmul dequantizes its weight in the forward and again
in the backward; compiled, the two dequantizations are one node of the joint graph, and a custom op is
never recomputed by default, so the forward would save every layer's weight in bf16 (resident QLoRA would
hold the whole model in bf16 by its last forward: experiments/h200-compile-memory). `RecomputeDequantization`
marks those nodes to be recomputed in the backward, as the eager matmul does: the forward saves the packed
weight and its statistics instead. Dequantization is exact, so recomputing it changes no value, and every
method compiles its layers with the same pass, so compiled runs stay comparable bit for bit.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from poros.engine.model.dequant_lowering import install_dequantize_lowerings
from poros.engine.model.held import Counted

DEQUANTIZE_NAMESPACE = "bitsandbytes"  # the namespace of bitsandbytes' registered ops


def is_dequantization(node: torch.fx.Node) -> bool:
    """A bitsandbytes dequantization (4-bit weights, and the blockwise statistics of double quantization)."""
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and target.namespace == DEQUANTIZE_NAMESPACE
            and target._opname.startswith("dequantize"))


class RecomputeDequantization:
    """A joint-graph pass (inductor's `joint_custom_pre_pass`, before the forward/backward partition): every
    bitsandbytes dequantization is recomputed in the backward, not saved by the forward. A pass installed
    before it (`previous`) runs first. Registered as inductor's `CustomGraphPass` when installed, so that its
    graph cache keeps working (it keys compiled code by the passes' `uuid`)."""

    def __init__(self, previous=None):
        self.previous = previous

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        for node in graph.nodes:
            if node.op == "call_function" and is_dequantization(node):
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE

    def uuid(self) -> str:
        """Part of the key of inductor's graph cache. It also says whether compiled backwards may donate their
        saved tensors' memory (`backward_keeps_saved_tensors`): the cache's own key does not, so without it a
        backward compiled to keep them could be handed one compiled earlier, or by another process, to reuse
        them."""
        import torch._functorch.config as functorch  # deferred: only runs that compile import it

        prior = self.previous.uuid() if hasattr(self.previous, "uuid") else repr(self.previous)
        saved = "donated" if functorch.donated_buffer else "kept"
        # the graphs it partitions are lowered with poros.engine.model.dequant_lowering's kernels
        return f"poros-recompute-dequantization-3:lowered:{saved}:{prior}"


def install_recompute_dequantization() -> None:
    """Inductor runs `RecomputeDequantization` on every training graph it compiles from now on, in this
    process (once: installing again changes nothing)."""
    # deferred: inductor is only imported when a run compiles
    import torch._inductor.config as inductor
    from torch._inductor.custom_graph_pass import CustomGraphPass

    CustomGraphPass.register(RecomputeDequantization)
    if not isinstance(inductor.joint_custom_pre_pass, RecomputeDequantization):
        inductor.joint_custom_pre_pass = RecomputeDequantization(inductor.joint_custom_pre_pass)


def enable_deterministic_compile() -> None:
    """Inductor's deterministic mode, process-wide, for runs with both `deterministic` and `compile`: no
    benchmark-driven choice between kernels (autotuning, padding), whose winner can change with timing and
    with it the bits of a compiled layer."""
    import torch._inductor.config as inductor  # deferred: inductor is only imported when a run compiles

    inductor.deterministic = True


def _donation_off() -> bool:
    import torch._functorch.config as functorch  # deferred: only runs that compile import it

    before, functorch.donated_buffer = functorch.donated_buffer, False
    return before


def _donation_back(before: bool) -> None:
    import torch._functorch.config as functorch

    functorch.donated_buffer = before


_saved_tensors_kept = Counted(_donation_off, _donation_back)


def backward_keeps_saved_tensors():
    """While entered, compiled backwards leave the tensors their forward saved as they are: AOTAutograd's
    donated buffers off. With them, a compiled backward that runs once per forward writes its own results into
    the memory of saved tensors it has read for the last time. A kept layer's template (poros/engine/runtime/graphs.py
    `KeptTemplate`) runs its backward more than once over one retained autograd graph (a warm-up, then the
    capture, then every replay, each step's forward replay refilling the same tensors), so a donated buffer
    would feed the second backward what the first wrote there. Only where results live changes, not how
    they are computed: every kernel and its bits stay the same. Process-wide, counted: nested or overlapping
    holders keep it off until the last one leaves."""
    return _saved_tensors_kept.held()


def install_layer_compilation() -> None:
    """What every compiled layer compiles with, in this process from now on: dequantization recomputed in its
    backward (`RecomputeDequantization`) and generated by inductor (poros/engine/model/dequant_lowering.py)."""
    install_recompute_dequantization()
    install_dequantize_lowerings()


def compile_module(module: nn.Module) -> None:
    """`module.compile()`, as every compiled layer compiles (`install_layer_compilation`)."""
    install_layer_compilation()
    module.compile()


def keep_mlp_eager(layers) -> None:
    """Each decoder layer's MLP left out of its compiled graph (`compile_mlp` off): its forward, the chunked one
    where `mlp_chunk` bound it, runs eager between the layer's compiled parts (torch.compiler.disable: dynamo
    splits the layer's graph there). Bound to the module itself, as the chunked forward is, so a copy of the layer
    runs its own MLP."""
    from poros.engine.model.mlp_chunk import mlp_of  # deferred: only runs that compile take it

    for i, layer in enumerate(layers):
        mlp = mlp_of(layer, f"layer {i}")
        mlp.forward = types.MethodType(torch.compiler.disable(mlp.forward.__func__), mlp)


def compile_layers(layers, mlp: bool = True) -> None:
    """Regional compilation as users run it: every decoder layer `layer.compile()`d (torch.compile of the
    module's call, so hooks and forward run compiled; the layers of one kind share compiled code); without `mlp`
    (`compile_mlp` off) each layer's MLP runs eager (`keep_mlp_eager`)."""
    if not mlp:
        keep_mlp_eager(layers)
    for layer in layers:
        compile_module(layer)
