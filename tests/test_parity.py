"""The parity gate on CPU: PASS across families, block sizes and accumulation; negative controls FAIL."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poros.build import build_store
from poros.config import TrainConfig
from poros.parity import parity

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]
N_LAYERS = 5  # every tiny shape; 2 does not divide it, 5 is all layers in one block


@pytest.mark.parametrize("grad_accum", [1, 2], ids=lambda g: f"accum={g}")
@pytest.mark.parametrize("block", [1, 2, N_LAYERS], ids=lambda k: f"block={k}")
@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_gate_passes(stores, model, block, grad_accum):
    cfg = TrainConfig(model=model, seq_len=64, block_size=block, grad_accum=grad_accum, lr=1e-2)
    result = parity(cfg, steps=3, store=stores(model))
    assert result.ok, f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"
    assert result.steps == 3 and result.first_mismatch is None and result.max_abs_diff == 0.0
    assert len(result.losses) == 3 * grad_accum
    # initial state + per step: losses, grads, weights, AdamW (exp_avg, exp_avg_sq, step) of every LoRA tensor
    assert result.tensors_compared > 3 * (grad_accum + 5 * 2 * 7 * 2)


def test_gate_json_line(stores):
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2)
    line = json.loads(parity(cfg, steps=1, store=stores("tiny-qwen3")).json())
    for key in ("parity", "steps", "tensors_compared", "first_mismatch", "max_abs_diff", "device", "attention"):
        assert key in line
    assert line["parity"] == "PASS" and line["device"] == "cpu" and line["attention"] == "default"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layers=st.integers(1, 6),
    block=st.integers(1, 7),
    seq=st.sampled_from([64, 96, 128]),
    steps=st.integers(1, 3),
    accum=st.integers(1, 2),
    family=st.sampled_from(TINY),
    offload=st.sampled_from([0.0, 0.5, 1.0]),
    overlap=st.booleans(),
)
def test_gate_property(layers, block, seq, steps, accum, family, offload, overlap, monkeypatch):
    from poros.build import Source
    from poros.registry import get_shape

    config = get_shape(family).config()
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = (config.layer_types * layers)[:layers]
    store, _ = build_store(Source(family, config), seed=layers, device="cpu", progress=False)
    monkeypatch.setattr("poros.offload.MIN_BYTES", 0)  # tiny tensors: offload them all
    cfg = TrainConfig(model=family, seq_len=seq, block_size=block, grad_accum=accum, lr=1e-2,
                      activation_offload=offload, overlap_backward=overlap)
    result = parity(cfg, steps=steps, store=store)
    assert result.ok, (f"{family} L={layers} K={block} seq={seq} offload={offload} overlap={overlap}: "
                       f"{result.first_mismatch}")


@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_gate_passes_with_serial_backward(stores, model):
    """The one-thread schedule (`overlap_backward: false`) is held to the same gate."""
    cfg = TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=2, lr=1e-2, overlap_backward=False)
    result = parity(cfg, steps=2, store=stores(model))
    assert result.ok, f"first mismatch {result.first_mismatch}"


def test_flipped_byte_in_host_store_fails_naming_the_layer(stores):
    """Negative control: the gate must see one changed byte of one layer's NF4 data."""
    from poros.build import build_store as fresh

    store = fresh("tiny-qwen2", seed=0, device="cpu", progress=False)[0]
    layer = store.layers[3]

    def flip(resident, poros):
        slot = layer.slots[-1]
        poros.store.arena[slot.weight_offset + 7] ^= 0x10

    result = parity(TrainConfig(model="tiny-qwen2", seq_len=64, block_size=2), steps=2, store=store, mutate=flip)
    assert result.parity == "FAIL"
    assert result.first_mismatch.startswith("model.layers.3."), result.first_mismatch


def test_flipped_byte_fails_in_training_too():
    """Without the initial weight check, the same corruption shows in the loss itself."""
    store = build_store("tiny-qwen2", seed=0, device="cpu", progress=False)[0]

    def flip(resident, poros):
        poros.store.arena[poros.store.layers[1].slots[0].weight_offset + 3] ^= 0x01

    cfg = TrainConfig(model="tiny-qwen2", seq_len=64, block_size=2)
    result = parity(cfg, steps=1, store=store, mutate=flip, verify_initial=False)
    assert result.parity == "FAIL" and result.first_mismatch == "step0.micro0.loss"


def test_refilling_a_buffer_before_backward_fails_on_gradients():
    """Negative control for the bitsandbytes trap: forward stays exact, gradients go wrong."""
    store = build_store("tiny-qwen3", seed=0, device="cpu", progress=False)[0]

    def trap(resident, poros):
        poros.fault_refill_before_backward = True

    result = parity(TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2), steps=2, store=store, mutate=trap)
    assert result.parity == "FAIL"
    assert ".grad:" in result.first_mismatch, result.first_mismatch
    assert result.losses and result.first_mismatch.startswith("step0.grad:")
