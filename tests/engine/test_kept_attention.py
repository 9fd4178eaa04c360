"""Kept attention (`keep_attention`): recomputes that take attention's results from the forward stay bitwise
resident QLoRA's, and the check can fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from poros.config import TrainConfig
from poros.engine.model import kept_attention
from poros.engine.methods.executor import PorosTrainer
from poros.engine.verify.parity import run_gate
from poros.engine.methods.trainer import ResidentTrainer
from poros.errors import ConfigError
from tests.faults import change_kept_attention_output

pytestmark = pytest.mark.usefixtures("fresh_compile_caches")  # tests/engine/conftest.py: some tests compile

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]


def gate(store, cfg, steps=2):
    """(gate result, poros's counters)"""
    resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg)
    try:
        return run_gate(resident, poros, steps), poros.counters()
    finally:
        resident.close()
        poros.close()


@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
@pytest.mark.parametrize("offload", [False, True], ids=["inputs on device", "inputs in host memory"])
def test_kept_attention_keeps_parity_and_skips_every_attention_forward(stores, model, offload):
    cfg = TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=2, lr=1e-2, keep_attention=True,
                      offload_inputs=offload)
    store = stores(model)
    result, c = gate(store, cfg)
    assert result.ok, result.first_mismatch
    # every layer's recompute, each micro-batch of both steps, took its attention from the forward
    assert c["attention_replayed"] == len(store.layers) * 2 * 2 and c["attention_computed"] == 0, c


def test_the_plan_counts_what_kept_attention_saves(stores):
    """The saved bytes the plan predicts are the bytes copied (flash's log-sum-exp is not padded on the CPU)."""
    cfg = TrainConfig(model="tiny-qwen2", seq_len=64, block_size=2, grad_accum=2, keep_attention=True,
                      offload_inputs=True)
    store = stores("tiny-qwen2")
    trainer = PorosTrainer(store, cfg)
    try:
        c = trainer.step().counters
        without = PorosTrainer(store, cfg.replace(keep_attention=False))
        try:
            inputs_only = without.step().counters["input_bytes_d2h"]
        finally:
            without.close()
    finally:
        trainer.close()
    assert c["input_bytes_d2h"] == c["input_bytes_h2d"] == trainer.plan.d2h_bytes_per_step
    assert c["input_bytes_d2h"] > inputs_only  # the attention results travel too
    assert trainer.plan.memory.saved_inputs > without.plan.memory.saved_inputs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_changed_kept_output_fails_the_gate(stores, monkeypatch, compiled):
    """Negative control: the recompute really takes the kept tensors. One value of each layer's kept attention
    output changed must FAIL."""
    change_kept_attention_output(monkeypatch)
    cfg = TrainConfig(model="tiny-qwen2", seq_len=64, block_size=2, lr=1e-2, keep_attention=True, compile=compiled)
    result, _ = gate(stores("tiny-qwen2"), cfg)
    assert not result.ok and ".grad:" in result.first_mismatch, result.first_mismatch


def _qkv(seq=64, heads=4, kv=2, dim=32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, h, seq, dim, generator=g, dtype=torch.bfloat16) for h in (heads, kv, kv)]


def _attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.fixture
def kernels():
    with kept_attention.installed():
        yield


def test_a_replayed_call_equals_the_computed_one_in_value_and_gradient(kernels):
    q, k, v = _qkv()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _attend(*leaves)
    grad = torch.randn_like(out)
    out.backward(grad)
    with torch.no_grad(), kept_attention.recording() as record:
        _attend(q, k, v)
    again = [t.clone().requires_grad_() for t in (q, k, v)]
    with kept_attention.replaying(record) as counts:
        out2 = _attend(*again)
    out2.backward(grad)
    assert counts == {"replayed": 1, "computed": 0}
    assert torch.equal(out, out2) and all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, again))


def test_a_call_unlike_the_recorded_one_is_computed_again(kernels):
    q, k, v = _qkv()
    with torch.no_grad(), kept_attention.recording() as record:
        _attend(q, k, v)
    short = [t[:, :, :32] for t in (q, k, v)]
    with torch.no_grad(), kept_attention.replaying(record) as counts:
        out = _attend(*short)
    assert counts == {"replayed": 0, "computed": 1}
    assert torch.equal(out, _attend(*short))


def test_a_call_with_dropout_is_not_recorded(kernels):
    q, k, v = _qkv()
    with torch.no_grad(), kept_attention.recording() as record:
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=True)
    assert record.calls == []


def test_the_kernels_are_registered_while_held_and_only_then():
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    has = lambda: torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "ADInplaceOrView")  # noqa: E731
    assert not has()
    with kept_attention.installed(), kept_attention.installed():
        assert has()
    assert not has()
    with pytest.raises(RuntimeError, match="installed"), kept_attention.recording():
        pass


def test_a_closed_trainer_leaves_no_kernel(stores):
    op = torch.ops.aten._scaled_dot_product_flash_attention.default
    trainer = PorosTrainer(stores("tiny-qwen2"), TrainConfig(model="tiny-qwen2", seq_len=64, keep_attention=True))
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "ADInplaceOrView")
    trainer.close()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "ADInplaceOrView")


@pytest.mark.parametrize("model", ["tiny-qwen2", pytest.param("tiny-gemma3", marks=[pytest.mark.slow, pytest.mark.extended])],
                         ids=lambda m: f"model={m}")
def test_compiled_layers_with_kept_attention_keep_parity(stores, model):
    """Compiled layers call the fused op from inductor's code: the recompute takes the kept results there too."""
    cfg = TrainConfig(model=model, seq_len=64, block_size=2, lr=1e-2, compile=True, keep_attention=True,
                      offload_inputs=True)
    store = stores(model)
    result, c = gate(store, cfg)
    assert result.ok, result.first_mismatch
    assert c["attention_replayed"] == len(store.layers) * 2 and c["attention_computed"] == 0, c


def test_kept_attention_is_refused_with_cuda_graphs():
    with pytest.raises(ConfigError, match="keep_attention"):
        TrainConfig(model="tiny-qwen2", keep_attention=True, cuda_graphs=True, device="cuda")


def test_a_recorded_memory_efficient_call_asks_for_its_log_sumexp():
    """Without autograd, memory-efficient attention skips its log-sum-exp; the record asks for it, as the call
    with autograd (resident's, and the recompute's) does, so the two calls match."""
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    args = ("q", "k", "v", None, False, 0.0, True)
    assert kept_attention.with_log_sumexp(efficient, args, {}) == (("q", "k", "v", None, True, 0.0, True), {})
    assert kept_attention.with_log_sumexp(efficient, args[:4], {"compute_log_sumexp": False}) == (
        args[:4], {"compute_log_sumexp": True})
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    assert kept_attention.with_log_sumexp(flash, args, {}) == (args, {})
