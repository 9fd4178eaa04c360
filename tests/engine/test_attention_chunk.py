"""The chunked attention block (`attention_chunk`): every method bitwise equal to resident QLoRA with the same
chunk, alone and with `mlp_chunk` (negative controls: a side without the chunk, a chunk that reads a shifted
token range), what a layer's forward saves for its backward with and without it, and the planner's count."""

from __future__ import annotations


import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from poros.config import Method, TrainConfig
from poros.engine.model import attention_chunk as A
from poros.engine.methods.registry import make_trainer
from poros.engine.verify.parity import parity, run_gate
from poros.engine.planning.memory import (
    ACT_ATTENTION_CHUNKED, attention_chunk_saving, layer_activation_bytes, transient_bytes)
from poros.engine.planning.search import build_plan
from poros.errors import ConfigError
from poros.choices import Attention
from tests.capabilities import requires_bitsandbytes
from tests.engine.chunk_gates import SEQ, STEPS, TINY, assert_pass, compiled_gate, config, shift_chunks, templates_gate
from tests.plans import plan_request

pytestmark = requires_bitsandbytes


# --- every method with the same chunk is bitwise equal ----------------------------------------------------


GATES = [(m, 48) for m in TINY] + [("tiny-qwen2", 32)] + [
    pytest.param(m, 32, marks=pytest.mark.slow) for m in TINY[1:]]


@pytest.mark.parametrize("model,chunk", GATES,
                         ids=lambda v: f"model={v}" if isinstance(v, str) else f"attention_chunk={v}")
def test_poros_equals_resident(stores, model, chunk):
    """Losses, every LoRA gradient, LoRA weights and AdamW state torch.equal over 3 steps."""
    assert_pass(parity(config(model, attention_chunk=chunk), steps=STEPS, store=stores(model)))


@pytest.mark.parametrize("model", ["tiny-qwen3", pytest.param("tiny-gemma4", marks=pytest.mark.slow)],
                         ids=lambda m: f"model={m}")
def test_resident_gc_equals_resident(stores, model):
    """resident_gc's layer checkpoints hold the chunks' checkpoints (nested): the same bits."""
    assert_pass(parity(config(model, attention_chunk=48), steps=STEPS, store=stores(model),
                       method=Method.RESIDENT_GC))


@pytest.mark.parametrize("settings", [
    dict(mlp_chunk=32),
    dict(mlp_chunk=32, lora_dropout=0.3),  # each chunk's masks pinned for its recompute on poros's backward thread
    dict(mlp_chunk=48, lora_compute="bf16", offload_inputs=True),
    pytest.param(dict(keep_attention=True), marks=pytest.mark.slow),
    pytest.param(dict(batch_size=2), marks=pytest.mark.slow),
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_poros_equals_resident_across_settings(stores, settings):
    assert_pass(parity(config("tiny-gemma3", attention_chunk=48, **settings), steps=STEPS,
                       store=stores("tiny-gemma3")))


def test_resident_gc_equals_resident_with_both_chunks(stores):
    assert_pass(parity(config("tiny-qwen2", attention_chunk=32, mlp_chunk=48, lora_dropout=0.3), steps=STEPS,
                       store=stores("tiny-qwen2"), method=Method.RESIDENT_GC))


@pytest.mark.parametrize("capture,keep", [
    pytest.param(False, False, id="templates=eager"), pytest.param(True, False, id="templates=stand-in-graphs"),
    pytest.param(True, True, id="templates=stand-in-graphs-kept", marks=pytest.mark.slow)])
def test_layer_templates_equal_resident(stores, monkeypatch, capture, keep):
    """Layer templates run their own copies of the layers, chunked: eagerly, or on the capture path with CPU
    stand-ins for the CUDA graph API (as tests/engine/test_mlp_chunk.py runs them)."""
    templates_gate(stores, monkeypatch, capture, keep, attention_chunk=48, mlp_chunk=48)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_compile_caches")
# poros's side in CI; the templates' and resident_gc's sides compile the same chunked layers (pytest -m extended)
@pytest.mark.parametrize("side", ["poros", pytest.param("poros-templates", marks=pytest.mark.extended),
                                  pytest.param("resident_gc", marks=pytest.mark.extended)], ids=lambda s: f"method={s}")
def test_compiled_methods_equal_compiled_resident(stores, side):
    """Compiled layers trace the chunks' checkpoints into their graphs; every method compiles the same layers."""
    compiled_gate(stores, side, attention_chunk=48, mlp_chunk=48)


@pytest.mark.slow
@pytest.mark.extended  # compile_mlp off is gated in tests/engine/test_mlp_chunk.py, the chunked block compiled above
@pytest.mark.usefixtures("fresh_compile_caches")
@pytest.mark.parametrize("side", ["poros", "resident_gc"], ids=lambda s: f"method={s}")
def test_compiled_layers_with_an_eager_mlp_equal_compiled_resident(stores, side):
    """compile_mlp off beside the chunked attention block: the layers' compiled parts around an eager, chunked
    MLP (the long-context matrices' settings)."""
    compiled_gate(stores, side, attention_chunk=48, mlp_chunk=48, compile_mlp=False)


# --- negative controls: the gate sees a side that chunks otherwise ----------------------------------------


@pytest.mark.parametrize("other", [dict(attention_chunk=None), dict(attention_chunk=None, mlp_chunk=32)],
                         ids=["without-attention_chunk", "mlp_chunk-only"])
def test_a_side_without_the_chunk_fails(stores, other):
    cfg = config("tiny-qwen2", attention_chunk=32, mlp_chunk=32)
    result = run_gate(make_trainer(Method.RESIDENT, stores("tiny-qwen2"), cfg),
                      make_trainer(Method.POROS, stores("tiny-qwen2"), cfg.replace(**other)), steps=1)
    assert result.parity == "FAIL" and ".grad:" in result.first_mismatch, result.first_mismatch


def test_a_chunk_reading_a_shifted_token_range_fails(stores):
    def mutate(resident, poros):
        for layer in poros.qlora.layers:
            shift_chunks(layer.self_attn.o_proj, layer.self_attn.o_proj.attention_chunk)

    result = parity(config("tiny-qwen2", attention_chunk=48), steps=1, store=stores("tiny-qwen2"), mutate=mutate)
    assert result.parity == "FAIL" and result.first_mismatch == "step0.micro0.loss", result.first_mismatch


# --- what a layer's forward saves for its backward --------------------------------------------------------


def _layer_call(trainer):
    """Layer 0 of a resident trainer and the arguments the model calls it with (seq SEQ + 64 tokens, so that
    no other width equals the sequence's)."""
    layer, got = trainer.qlora.layers[0], {}
    hook = layer.register_forward_pre_hook(lambda m, a, k: got.setdefault("call", (a, k)), with_kwargs=True)
    with torch.no_grad():
        trainer.model(input_ids=torch.randint(0, 1000, (1, trainer.cfg.seq_len), generator=torch.Generator()))
    hook.remove()
    return layer, *got["call"]


def _saved(layer, args, kwargs) -> dict[int, tuple[int, torch.dtype]]:
    """Storage -> (bytes, dtype) of what the layer's forward saves for its backward, but the layer's input
    and its parameters and buffers."""
    ignore = {StorageWeakRef(t.untyped_storage()).cdata for t in (*layer.parameters(), *layer.buffers())}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        saved[StorageWeakRef(s).cdata] = (s.nbytes(), t.dtype)
        return t

    x = args[0].detach().clone().requires_grad_(True)
    ignore.add(StorageWeakRef(x.untyped_storage()).cdata)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, *args[1:], **kwargs)
    return {k: v for k, v in saved.items() if k not in ignore}


@pytest.mark.parametrize("chunk", [32, 4096], ids=lambda c: f"attention_chunk={c}")
def test_the_forward_saves_no_float32_copy_of_the_sequence(stores, chunk):
    """With the chunk a layer's forward saves no float32 tensor of the sequence's hidden width (the norms' and
    the LoRA layers' float32 copies are one chunk's, inside its checkpoint), and what it saves shrinks by at
    least ACT_ATTENTION_CHUNKED bytes per token per hidden unit, the planner's term. Control: a chunk of the
    whole sequence or more (4096) chunks nothing: the float32 copies are saved and nothing shrinks."""
    seq = SEQ + 64
    sizes = {}
    for c in (None, chunk):
        trainer = make_trainer(Method.RESIDENT, stores("tiny-qwen2"),
                               config("tiny-qwen2", seq_len=seq, mlp_chunk=32, lora_compute="fp32", attention_chunk=c))
        hidden = trainer.store.config.hidden_size
        saved = _saved(*_layer_call(trainer))
        wide_fp32 = [b for b, dtype in saved.values() if dtype is torch.float32 and b >= seq * hidden * 4]
        assert bool(wide_fp32) is (c != 32), (c, wide_fp32)
        sizes[c] = sum(b for b, _ in saved.values())
        trainer.close()
    removed = sizes[None] - sizes[chunk]
    if chunk < seq:
        assert removed >= seq * hidden * ACT_ATTENTION_CHUNKED, (removed / seq / hidden)
    else:
        assert removed == 0


def test_a_layer_without_attention_projections_is_refused():
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    with pytest.raises(ConfigError) as e:
        A.use_chunked_attention(layers, 8)
    assert e.value.problems == ["attention_chunk: chunks the projections of a decoder layer's `self_attn` module, "
                                "and layer 0 (Linear) has none; drop attention_chunk for this model"]


def test_the_chunked_modules_are_the_projections_and_norms(stores):
    """Every projection's forward is bound to its peft LoRA layer (the adapters inside the chunk); Gemma's four
    layer norms and the Qwen's two."""
    for model, norms in (("tiny-qwen2", 2), ("tiny-gemma3", 4)):
        trainer = make_trainer(Method.RESIDENT, stores(model), config(model, attention_chunk=48))
        layer = trainer.qlora.layers[0]
        modules = A.chunked_modules(layer, "layer 0")
        assert len(modules) == 4 + norms
        for m in modules:
            assert m.forward.__func__ is A.chunked_forward and m.forward.__self__ is m and m.attention_chunk == 48
        assert hasattr(layer.self_attn.q_proj, "lora_A")
        trainer.close()


# --- the planner's memory model ---------------------------------------------------------------------------


def test_the_layer_transient_shrinks_with_the_chunk(q72):
    seq, batch = 32768, 2
    layer = {c: transient_bytes(q72, seq, batch, Attention.FAST, overlap=False, mlp_chunk=1024, attention_chunk=c)[1]
             for c in (None, 16384, 4096, 1024, seq, 10 * seq)}
    assert layer[None] > layer[16384] > layer[4096] > layer[1024]
    for c in (16384, 4096, 1024):
        assert layer[None] - layer[c] == (seq - c) * batch * ACT_ATTENTION_CHUNKED * q72.hidden
        assert layer[None] - layer[c] == attention_chunk_saving(q72, seq * batch, batch, c)
    assert layer[seq] == layer[10 * seq] == layer[None]  # a chunk of the whole sequence or more: no change
    saved = layer_activation_bytes(q72, seq, 1, Attention.FAST) - layer_activation_bytes(q72, seq, 1, Attention.FAST,
                                                                                         attention_chunk=4096)
    assert saved == (seq - 4096) * ACT_ATTENTION_CHUNKED * q72.hidden


def test_a_plan_with_the_chunk_predicts_less(q72):
    cfg = TrainConfig(model="qwen2.5-72b", seq_len=32768, attention="fast", loss_chunk=4096, mlp_chunk=4096,
                      device="cuda")
    plain = build_plan(q72, plan_request(cfg, offload_inputs=True))
    chunked = build_plan(q72, plan_request(cfg.replace(attention_chunk=4096), offload_inputs=True))
    assert chunked.memory.transient < plain.memory.transient and chunked.memory.total < plain.memory.total
