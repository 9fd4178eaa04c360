"""Inductor's own NF4 dequantization in compiled layers (poros/engine/model/dequant_lowering.py) gives bitsandbytes'
bytes: compiled `dequantize_4bit` against bitsandbytes' eager kernel, bit for bit, with and without double
quantization, where it is generated and where it falls back to bitsandbytes' kernel. On CPU inductor generates
C++; with -m gpu the same checks run Triton code against bitsandbytes' CUDA kernels at the shapes of
qwen2.5-72b's projections."""

from __future__ import annotations

import bitsandbytes.functional as F
import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor
from torch._inductor.utils import run_and_get_code

from poros.engine.model import dequant_lowering
from poros.engine.model.dequant_lowering import install_dequantize_lowerings
from tests.capabilities import requires_gpu

# a call of bitsandbytes' kernel in generated code (comments name the ops too, without the call)
BNB_4BIT = "torch.ops.bitsandbytes.dequantize_4bit.default("
BNB_BLOCKWISE = "torch.ops.bitsandbytes.dequantize_blockwise.default("


def _nf4(shape, double_quant: bool, device: str):
    w = torch.randn(*shape, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(sum(shape))).to(device)
    return F.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type="nf4")


def compiled_dequantize(packed, state) -> tuple[torch.Tensor, str]:
    """`dequantize_4bit` compiled with the lowerings installed (no graph cache: each call generates its code),
    and the generated code."""
    install_dequantize_lowerings()
    torch._dynamo.reset()
    with inductor.patch(fx_graph_cache=False):
        out, (code, *_) = run_and_get_code(torch.compile(lambda p: F.dequantize_4bit(p, state), fullgraph=True),
                                           packed)
    torch._dynamo.reset()
    return out, code


# (shape, double quantization, generated: what inductor generates itself; the rest calls bitsandbytes)
CPU_CASES = [
    ((384, 320), False, {BNB_4BIT: True}),
    ((512, 256), True, {BNB_4BIT: True, BNB_BLOCKWISE: True}),  # 2,048 absmax: whole nested blocks of 256
    ((384, 320), True, {BNB_4BIT: True, BNB_BLOCKWISE: False}),  # 1,920 absmax: the last nested block is short
    ((64, 96), False, {BNB_4BIT: False}),  # rows of 1.5 blocks
]


@pytest.mark.parametrize("shape,double_quant,generated", CPU_CASES, ids=str)
def test_compiled_dequantization_gives_bitsandbytes_bytes(shape, double_quant, generated):
    packed, state = _nf4(shape, double_quant, "cpu")
    out, code = compiled_dequantize(packed, state)
    assert out.dtype == torch.bfloat16 and out.shape == shape
    assert torch.equal(out, F.dequantize_4bit(packed, state))
    for op, own in generated.items():
        assert (op not in code) == own, f"{op} {'called' if own else 'not called'} in:\n{code}"


def test_a_wrong_nf4_table_fails_the_comparison(monkeypatch):
    """Negative control: the same comparison with the NF4 table reversed in the generated code."""
    packed, state = _nf4((384, 320), False, "cpu")
    monkeypatch.setattr(dequant_lowering, "nf4_values", lambda: tuple(reversed(F.get_4bit_type("nf4", device="cpu").tolist())))
    out, code = compiled_dequantize(packed, state)
    assert BNB_4BIT not in code
    assert not torch.equal(out, F.dequantize_4bit(packed, state))


QWEN72B_SHAPES = [(8192, 8192), (1024, 8192), (29568, 8192), (8192, 29568)]  # q/o, k/v, gate/up, down


@pytest.mark.gpu
@requires_gpu(1)
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
@pytest.mark.parametrize("shape", QWEN72B_SHAPES, ids=str)
def test_gpu_compiled_dequantization_gives_bitsandbytes_bytes(shape, double_quant):
    packed, state = _nf4(shape, double_quant, "cuda")
    out, code = compiled_dequantize(packed, state)
    assert torch.equal(out, F.dequantize_4bit(packed, state))
    assert BNB_4BIT not in code and BNB_BLOCKWISE not in code, code  # 1,024 absmax per nested block: all generated
