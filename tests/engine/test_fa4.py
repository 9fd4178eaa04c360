"""`attention: fa4` on the CPU (poros/engine/model/fa4.py, poros/engine/model/attention.py): FA4's kernels replaced by
a reference in their layout (SDPA's math, batch x seqlen x heads x head_dim), so that the routing, the custom ops,
their fake implementations under torch.compile and the record of each shape's backend are checked without a GPU.
What FA4's own kernels do (their speed, their bits) is for the GPU: scripts/attention_probe.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from poros.choices import ATTENTION_NEEDS, Attention, Device
from poros.engine.model import fa4
from poros.engine.model.attention import BackendLog, sdpa_context


class ReferenceFA4:
    """FA4's forward and backward as exact math on the CPU, in FA4's layout and return values (out in the inputs'
    dtype, lse float32 of batch x heads x seqlen; dq, dk, dv like their inputs, grouped heads summed). `calls`:
    what ran, the backward with the `deterministic` it was asked for. `noise`: a backward whose dq differs from
    call to call by that much (an atomic accumulation's), for the gate's negative control."""

    device = "cpu"

    def __init__(self, noise: float = 0.0):
        self.calls: list = []
        self.noise = noise

    @staticmethod
    def _probabilities(q, k, scale, causal):
        scores = q @ k.transpose(-1, -2) * scale
        if causal:
            rows, cols = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool).triu(1), float("-inf"))
        return scores

    @staticmethod
    def _heads_first(q, k, v):
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
        groups = q.shape[1] // k.shape[1]
        return q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), groups

    def forward(self, q, k, v, scale, causal):
        self.calls.append("forward")
        qh, kh, vh, _ = self._heads_first(q, k, v)
        scores = self._probabilities(qh, kh, scale, causal)
        lse = scores.logsumexp(-1)
        out = (scores - lse[..., None]).exp() @ vh
        return out.transpose(1, 2).to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, scale, causal, deterministic):
        self.calls.append(("backward", deterministic))
        qh, kh, vh, groups = self._heads_first(q, k, v)
        do, o = (t.transpose(1, 2).float() for t in (dout, out))
        p = (self._probabilities(qh, kh, scale, causal) - lse[..., None]).exp()
        dv = p.transpose(-1, -2) @ do
        ds = p * (do @ vh.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
        dq, dk = ds @ kh * scale, ds.transpose(-1, -2) @ qh * scale
        if self.noise:
            dq = dq + self.noise * torch.rand_like(dq)

        def fold(g):  # grouped query heads' gradients summed into their key/value head
            b, h, s, d = g.shape
            return g.view(b, h // groups, groups, s, d).sum(2)

        return tuple(g.transpose(1, 2).to(t.dtype) for g, t in zip((dq, fold(dk), fold(dv)), (q, k, v)))


@pytest.fixture
def reference(monkeypatch):
    """FA4's kernels replaced by the reference for one test."""
    kernel = ReferenceFA4()
    monkeypatch.setattr(fa4, "KERNEL", kernel)
    return kernel


@pytest.fixture
def restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def _qkv(heads=4, kv_heads=2, seq=64, dim=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(1, h, seq, dim, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def _math(q, k, v, **kw):
    """SDPA's math backend in float32, the reference both paths are held to."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)


def _grads(out, inputs, seed=1):
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, grad)


def _close(a, b, what):
    assert torch.allclose(a.float(), b.float(), atol=3e-2, rtol=3e-2), \
        f"{what}: differs by {(a.float() - b.float()).abs().max().item():.3g}"


def test_a_causal_call_runs_on_fa4_and_matches_sdpa_math(reference):
    q, k, v = _qkv()
    with BackendLog() as log, sdpa_context(Attention.FA4):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grads = _grads(out, (q, k, v))
    assert reference.calls == ["forward", ("backward", False)]
    assert log.seen == {"head_dim 16, heads 4/2, causal": "fa4"}
    expected = _math(q, k, v, is_causal=True, enable_gqa=True)
    _close(out, expected, "out")
    for name, got, want in zip("qkv", grads, _grads(expected, (q, k, v))):
        _close(got, want, f"d{name}")
    assert out.shape == expected.shape and out.dtype == torch.bfloat16


def test_calls_fa4_does_not_serve_run_on_the_fast_list(reference):
    """A mask, dropout, float32, or query and key lengths that differ under causal: SDPA, as `fast` runs them,
    recorded under SDPA's backend; and `fast` itself (the negative control) never routes a call to FA4."""
    q, k, v = _qkv(heads=4, kv_heads=4)
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    with BackendLog() as log, sdpa_context(Attention.FA4):
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        F.scaled_dot_product_attention(q[:, :, :32], k, v, is_causal=True)
    assert reference.calls == []
    assert set(log.seen.values()) == {"flash"}, log.seen  # torch's CPU flash kernel takes all three
    _close(masked, _math(q, k, v, attn_mask=mask), "masked out")
    with BackendLog() as log, sdpa_context(Attention.FAST):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert reference.calls == [] and log.seen == {"head_dim 16, heads 4/4, causal": "flash"}
    with BackendLog() as log, sdpa_context(Attention.FA4, routed=False):  # Unsloth's child
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert reference.calls == [] and log.seen == {"head_dim 16, heads 4/4, causal": "flash"}
    with sdpa_context(Attention.FA4):  # and the same call routed, where it is
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert reference.calls == ["forward"]


def test_without_a_kernel_for_the_device_nothing_is_routed():
    """FA4's own kernels run on CUDA: a CPU tensor never reaches them, whatever the setting."""
    q, k, v = _qkv()
    assert fa4.KERNEL.device == "cuda"
    assert not fa4.serves(q, k, v, is_causal=True, enable_gqa=True)
    with BackendLog() as log, sdpa_context(Attention.FA4):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert log.seen == {"head_dim 16, heads 4/2, causal": "flash"}


@pytest.mark.parametrize("case,served", [
    ("causal", True), ("unmasked", True), ("mask", False), ("dropout", False), ("float32", False),
    ("gqa without enable_gqa", False), ("heads not a multiple", False), ("shorter queries, causal", False),
    ("shorter queries, unmasked", True), ("head_dim 160", False), ("head_dim 256", True), ("head_dim 192/128", True),
    ("head_dim 512", False), ("head_dim 12", False),
], ids=lambda x: x if isinstance(x, str) else None)
def test_what_fa4_serves(reference, case, served):
    q, k, v = _qkv(heads=4, kv_heads=2, dim=16)
    kw = dict(is_causal=True, enable_gqa=True)
    if case == "unmasked":
        kw["is_causal"] = False
    elif case == "mask":
        kw = dict(attn_mask=torch.ones(64, 64, dtype=torch.bool), enable_gqa=True)
    elif case == "dropout":
        kw["dropout_p"] = 0.1
    elif case == "float32":
        q, k, v = _qkv(dtype=torch.float32)
    elif case == "gqa without enable_gqa":
        kw["enable_gqa"] = False
    elif case == "heads not a multiple":
        q, k, v = _qkv(heads=3, kv_heads=2)
    elif case.startswith("shorter queries"):
        q = q[:, :, :32]
        kw["is_causal"] = case.endswith("causal")
    elif case.startswith("head_dim"):
        d, _, dv = case.removeprefix("head_dim ").partition("/")
        q, k, _ = _qkv(dim=int(d))
        v = _qkv(dim=int(dv or d))[2]
    assert fa4.serves(q, k, v, **kw) is served


def test_deterministic_mode_asks_fa4_for_its_deterministic_backward(reference, restore_determinism):
    q, k, v = _qkv()
    for strict in (True, False):
        torch.use_deterministic_algorithms(strict)
        with sdpa_context(Attention.FA4):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        _grads(out, (q, k, v))
        assert reference.calls[-1] == ("backward", strict)


def test_the_ops_pass_torch_library_checks(reference):
    """Schema, fake implementation against the real one, autograd registration, and AOT dispatch (what
    torch.compile traces), for both ops."""
    q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in _qkv())
    torch.library.opcheck(torch.ops.poros.fa4_forward.default, (q, k, v, 0.25, True, True))
    out, lse = torch.ops.poros.fa4_forward(q.detach(), k.detach(), v.detach(), 0.25, True, True)
    torch.library.opcheck(torch.ops.poros.fa4_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.25, True, True))


def test_a_compiled_layer_keeps_fa4_in_its_graph(reference):
    """torch.compile traces the routing through the fake implementations in one graph (fullgraph: no break):
    forward and backward graphs call the ops, and run the same kernels to the same bits as eager."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()

    def layer(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    q, k, v = _qkv()
    with sdpa_context(Attention.FA4):
        out = compiled(q, k, v)
        eager = layer(q, k, v)
    grads, eager_grads = _grads(out, (q, k, v)), _grads(eager, (q, k, v))
    assert torch.equal(out, eager) and all(torch.equal(a, b) for a, b in zip(grads, eager_grads))
    assert "poros.fa4_forward" in backend.fw_graphs[0].code and "poros.fa4_backward" in backend.bw_graphs[0].code
    assert reference.calls.count("forward") == 2
    torch._dynamo.reset()


@pytest.fixture
def fa4_on_the_cpu(monkeypatch, reference):
    """A machine whose FA4 kernels run on the CPU: the declared device need moved there, the reference kernel in."""
    monkeypatch.setitem(ATTENTION_NEEDS, Attention.FA4,
                        dataclasses.replace(ATTENTION_NEEDS[Attention.FA4], device=Device.CPU))
    return reference


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma3"])
def test_both_methods_run_the_same_fa4_calls_and_keep_parity(stores, fa4_on_the_cpu, model):
    """Resident QLoRA and poros route the same calls (gemma3's sliding-window layers, masked, stay on SDPA) and
    gate PASS on them; every FA4 call records as fa4."""
    from poros.config import Method, TrainConfig
    from poros.engine.methods.registry import make_trainer
    from poros.engine.verify.parity import run_gate

    cfg = TrainConfig(model=model, seq_len=64, block_size=2, attention="fa4", lr=1e-2)
    resident, poros = make_trainer(Method.RESIDENT, stores(model), cfg), make_trainer(Method.POROS, stores(model), cfg)
    assert run_gate(resident, poros, 1).ok
    assert resident.attention_backends == poros.attention_backends
    full = {k: v for k, v in resident.attention_backends.items() if k.endswith("causal")}
    masked = {k: v for k, v in resident.attention_backends.items() if k.endswith("mask")}
    assert full and set(full.values()) == {"fa4"}
    assert set(masked.values()) <= {"flash"} and bool(masked) == (model == "tiny-gemma3")
    assert ("backward", False) in fa4_on_the_cpu.calls


def test_a_backward_that_does_not_repeat_fails_the_gate(stores, fa4_on_the_cpu):
    """The negative control: FA4's backward with dq off by a different amount each call (atomic adds) must FAIL."""
    from poros.config import Method, TrainConfig
    from poros.engine.methods.registry import make_trainer
    from poros.engine.verify.parity import run_gate

    fa4_on_the_cpu.noise = 1e-3
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2, attention="fa4", lr=1e-2)
    store = stores("tiny-qwen3")
    resident, poros = make_trainer(Method.RESIDENT, store, cfg), make_trainer(Method.POROS, store, cfg)
    assert not run_gate(resident, poros, 1).ok


def _has_fa4() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _has_fa4(), reason="requires flash-attn-4 (flash_attn.cute), not installed")
def test_the_calls_compile_against_flash_attn_4s_interface(monkeypatch):
    """FA4's own forward and backward (strict and not) on fake tensors of grouped heads as qwen2.5-72b's: its interface
    takes the calls as this module makes them and compiles their kernels, returning what the fake implementations
    say. On a CPU for a cross-compiled target, as its interface documents, given before the process starts
    (cutlass reads it as it loads):
        FLASH_ATTENTION_ARCH=sm_90 CUTE_DSL_ARCH=sm_90a FLASH_ATTENTION_NUM_SMS=132 pytest tests/engine/test_fa4.py"""
    import os

    from torch._subclasses.fake_tensor import FakeTensorMode

    if not torch.cuda.is_available():
        if not all(os.environ.get(n) for n in ("FLASH_ATTENTION_ARCH", "CUTE_DSL_ARCH", "FLASH_ATTENTION_NUM_SMS")):
            pytest.skip("no GPU and no cross-compilation target (FLASH_ATTENTION_ARCH, CUTE_DSL_ARCH, "
                        "FLASH_ATTENTION_NUM_SMS)")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # DLPack asks it of a CUDA tensor
    from flash_attn.cute import interface

    interface._get_device_arch.cache_clear()
    kernel, scale = fa4.FlashAttention4(), 128 ** -0.5
    try:
        with FakeTensorMode():
            q, k, v = (torch.empty(1, 256, h, 128, dtype=torch.bfloat16, device="cuda") for h in (8, 2, 2))
            out, lse = kernel.forward(q, k, v, scale, True)
            want = fa4._forward_shapes(q, k, v, scale, True, True)
            assert (out.shape, out.dtype, lse.shape, lse.dtype) == (want[0].shape, want[0].dtype, want[1].shape,
                                                                     want[1].dtype)
            for deterministic in (True, False):
                grads = kernel.backward(torch.empty_like(out), q, k, v, out, lse, scale, True, deterministic)
                assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    finally:
        interface._get_device_arch.cache_clear()


@pytest.mark.parametrize("schedule", [
    pytest.param("compiled", marks=[pytest.mark.slow, pytest.mark.extended]),  # inductor on two cores: ~30 s
    "templates"])
def test_compiled_layers_and_layer_templates_keep_parity_on_fa4(stores, fa4_on_the_cpu, schedule):
    """The ops inside inductor-compiled layers (the fake implementations traced, the real ones called from the
    compiled code), and inside poros's layer templates (run eagerly on the CPU): the gate PASSes, FA4 ran."""
    from poros.config import Method, TrainConfig
    from poros.engine.methods.registry import make_trainer
    from poros.engine.verify.parity import run_gate

    torch._dynamo.reset()
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2, attention="fa4", lr=1e-2,
                      compile=schedule == "compiled")
    store = stores("tiny-qwen3")
    resident, poros = make_trainer(Method.RESIDENT, store, cfg), make_trainer(Method.POROS, store, cfg)
    if schedule == "templates":
        poros.use_layer_templates(capture=False)
    try:
        assert run_gate(resident, poros, 1).ok
    finally:
        torch._dynamo.reset()
    assert ("backward", False) in fa4_on_the_cpu.calls
    if schedule == "templates":
        assert set(poros.attention_backends.values()) == {"fa4"}
