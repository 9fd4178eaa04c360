"""`attention: fa4` on the GPU: FlashAttention-4's kernels against SDPA's, their deterministic backward repeating bit
for bit, a call captured in a CUDA graph, and the parity gate with every schedule a matrix runs (eager, compiled,
CUDA-graph templates). Needs flash-attn-4 (on an offline machine: scripts/stage_fa4.sh, then scripts/device_fa4.sh):

    . scripts/device_env.sh && CUBLAS_WORKSPACE_CONFIG=:4096:8 pytest -m gpu tests/engine/test_gpu_fa4.py -s
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from poros.engine.methods.trainer import set_cublas_workspace
from tests.capabilities import requires_gpu, requires_module

set_cublas_workspace()  # before anything touches CUDA: repeatable matmuls under strict determinism

pytestmark = [pytest.mark.gpu, requires_gpu(1), requires_module("flash_attn"),
              pytest.mark.usefixtures("fresh_compile_caches")]
TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3"]


def _layer(seq: int, heads=64, kv_heads=8, dim=128):
    """qwen2.5-72b's attention shapes as a layer hands them to SDPA (batch, heads, seqlen, head_dim), bf16."""
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(1, seq, h, dim, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                 generator=g).transpose(1, 2).requires_grad_()
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    return q, k, v, torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)


def _attend(q, k, v, deterministic: bool):
    from poros.engine.model import fa4

    return fa4.attention(q, k, v, True, None, deterministic)


def test_gpu_fa4_matches_sdpa_flash_and_its_deterministic_backward_repeats():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, grad = _layer(4096)
    out = _attend(q, k, v, True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    runs = [torch.autograd.grad(out, (q, k, v), grad, retain_graph=True) for _ in range(2)]
    scale = lambda t: t.float().abs().max().item()  # noqa: E731
    assert (out - ref).float().abs().max().item() <= 2e-2 * scale(ref)
    for name, got, want in zip("qkv", runs[0], ref_grads):
        assert (got - want).float().abs().max().item() <= 2e-2 * scale(want), f"d{name}"
    assert all(torch.equal(a, b) for a, b in zip(*runs)), "the deterministic backward did not repeat"


def test_gpu_fa4_captures_in_a_cuda_graph_and_replays_the_eager_bits():
    """A forward and deterministic backward captured after one warm-up call (FA4 compiles its kernels on its first
    call for a shape), replayed: the same bits as eager."""
    q, k, v, grad = _layer(2048)
    eager = torch.autograd.grad(_attend(q, k, v, True), (q, k, v), grad)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.autograd.grad(_attend(q, k, v, True), (q, k, v), grad)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.autograd.grad(_attend(q, k, v, True), (q, k, v), grad)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))


@pytest.mark.parametrize("schedule", ["eager", "compiled", "cuda_graphs", "compiled+cuda_graphs"])
@pytest.mark.parametrize("model", TINY, ids=[f"model={m}" for m in TINY])
def test_gpu_fa4_keeps_parity(model, schedule):
    """Resident QLoRA and poros on fa4 under strict determinism gate PASS, every layer template captured where
    there are templates (a capture that fails falls back to eager with a warning: refused here)."""
    from poros.config import TrainConfig
    from poros.engine.methods.executor import PorosTrainer
    from poros.engine.methods.trainer import ResidentTrainer
    from poros.engine.verify.parity import run_gate
    from poros.store.build import build_store

    store = build_store(model, seed=0, device="cuda", progress=False)[0]
    cfg = TrainConfig(model=model, seq_len=256, block_size=2, device="cuda", attention="fa4", deterministic=True,
                      lr=1e-2, compile="compiled" in schedule, cuda_graphs="cuda_graphs" in schedule)
    resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run_gate(resident, poros, 2)
        backends = resident.attention_backends
    finally:
        resident.close()
        poros.close()
    print(model, schedule, result.json(), backends)
    assert result.ok, f"{model} {schedule}: first mismatch {result.first_mismatch}"
    failed = [str(w.message) for w in caught if "CUDA graph capture failed" in str(w.message)]
    assert not failed, failed[0]
    if not cfg.compile:  # compiled layers record no backends
        assert "fa4" in backends.values(), backends
