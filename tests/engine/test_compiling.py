"""Compiled layers recompute bitsandbytes' dequantization in their backward instead of saving bf16 weights
(poros/engine/model/compiling.py): shown on an NF4 matmul written as the GPU path of bitsandbytes' 4-bit matmul
runs it (dequantize, then a bf16 matmul), which the CPU path of `matmul_4bit` does not (it multiplies packed
weights directly in its forward)."""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor

from poros.engine.model.compiling import RecomputeDequantization, install_recompute_dequantization, is_dequantization
from tests.capabilities import requires_gpu

OUT, IN = 256, 128


@pytest.fixture
def nf4():
    torch.manual_seed(0)
    packed, state = F.quantize_4bit(torch.randn(OUT, IN, dtype=torch.bfloat16), quant_type="nf4", blocksize=64)
    return packed, state


def saved_by_compiled(nf4, install: bool, device: str = "cpu") -> tuple[list[tuple], torch.Tensor]:
    """The tensors the compiled function's forward saves for its backward, and the input's gradient. On the
    CPU the function dequantizes and multiplies as bitsandbytes' matmul does on a GPU; on a GPU it is
    `bitsandbytes.matmul_4bit` itself."""
    packed, state = nf4
    if device == "cpu":
        def matmul(x):
            return x @ F.dequantize_4bit(packed, state).to(x.dtype).t()
    else:
        packed = packed.to(device)
        state.to(device)  # in place (QuantState.to returns nothing)

        def matmul(x):
            return bnb.matmul_4bit(x, packed.t(), quant_state=state)

    def f(x):
        return matmul(x).float().square().sum()

    torch._dynamo.reset()
    x = torch.randn(64, IN, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1)).to(device)
    x.requires_grad_(True)
    saved = []
    with inductor.patch(joint_custom_pre_pass=None):
        if install:
            install_recompute_dequantization()
        compiled = torch.compile(f)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                      lambda t: t):
            y = compiled(x)
        y.backward()
    torch._dynamo.reset()
    return saved, x.grad


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_gpu(1)])]


def _dequantized(saved) -> bool:
    """Whether a bf16 weight (either orientation: a backward may keep its transpose) is among `saved`."""
    return any(dtype == torch.bfloat16 and sorted(shape) == sorted((OUT, IN)) for shape, dtype in saved)


@pytest.mark.parametrize("device", DEVICES)
def test_the_forward_saves_the_packed_weight_not_the_dequantized_one(nf4, device):
    saved, grad = saved_by_compiled(nf4, install=True, device=device)
    assert not _dequantized(saved), saved
    if device == "cpu":  # on a GPU the packed weight is a constant of the compiled graph, read without saving
        assert any(dtype == torch.uint8 for _, dtype in saved), saved  # the packed weight, dequantized in backward
    control, control_grad = saved_by_compiled(nf4, install=False, device=device)
    assert _dequantized(control), control  # negative control: without the pass the bf16 weight is saved
    assert torch.equal(grad, control_grad)  # recomputing the dequantization changes no value


def test_installing_is_idempotent_and_keeps_a_pass_installed_before():
    seen = []

    def before(graph):
        seen.append(graph)

    with inductor.patch(joint_custom_pre_pass=before):
        install_recompute_dequantization()
        install_recompute_dequantization()
        p = inductor.joint_custom_pre_pass
        assert isinstance(p, RecomputeDequantization) and p.previous is before
        graph = torch.fx.Graph()
        p(graph)
        assert seen == [graph]
        from torch._inductor.custom_graph_pass import CustomGraphPass

        assert isinstance(p, CustomGraphPass) and p.uuid().startswith("poros-recompute-dequantization")


def test_only_bitsandbytes_dequantizations_are_marked():
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    nodes = [graph.call_function(torch.ops.bitsandbytes.dequantize_4bit.default, (a,)),
             graph.call_function(torch.ops.aten.mm.default, (a, a))]
    assert [is_dequantization(n) for n in nodes] == [True, False]


def test_donated_buffers_stay_off_until_the_last_holder_leaves():
    """Two trainers with kept compiled layers may close in either order: the first to close must not turn
    donated buffers back on under the other."""
    import torch._functorch.config as functorch

    from poros.engine.model.compiling import backward_keeps_saved_tensors

    before = functorch.donated_buffer
    first, second = backward_keeps_saved_tensors(), backward_keeps_saved_tensors()
    first.__enter__()
    second.__enter__()
    assert functorch.donated_buffer is False
    first.__exit__(None, None, None)  # out of order: the second still holds
    assert functorch.donated_buffer is False
    second.__exit__(None, None, None)
    assert functorch.donated_buffer == before
