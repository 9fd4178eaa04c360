"""The parity gate on CPU: PASS across families, block sizes and accumulation; negative controls FAIL."""

from __future__ import annotations

import json

import pytest

from poros.store.build import build_store
from poros.config import TrainConfig
from poros.engine.verify.parity import parity

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


@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_gate_passes_with_serial_backward(stores, model):
    """The one-thread schedule (`overlap_backward: false`) is held to the same gate."""
    cfg = TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=2, lr=1e-2, overlap_backward=False)
    result = parity(cfg, steps=2, store=stores(model))
    assert result.ok, f"first mismatch {result.first_mismatch}"


def test_flipped_byte_in_host_store_fails_naming_the_layer(stores):
    """Negative control: the gate must see one changed byte of one layer's NF4 data."""
    from poros.store.build import build_store as fresh

    store = fresh("tiny-qwen2", seed=0, device="cpu", progress=False)[0]
    layer = store.layers[3]

    def flip(resident, poros):
        slot = layer.slots[-1]
        poros.store.arena[slot.weight_offset + 7] ^= 0x10

    result = parity(TrainConfig(model="tiny-qwen2", seq_len=64, block_size=2), steps=2, store=store, mutate=flip)
    assert result.parity == "FAIL"
    assert result.first_mismatch.startswith("model.layers.3."), result.first_mismatch


def test_flipped_byte_fails_in_training_too():
    """Without the initial weight check, the same corruption shows in the loss itself (layer 4: a block
    the plan loads during the step, not one its setup left on the device)."""
    store = build_store("tiny-qwen2", seed=0, device="cpu", progress=False)[0]

    def flip(resident, poros):
        poros.store.arena[poros.store.layers[4].slots[0].weight_offset + 3] ^= 0x01

    cfg = TrainConfig(model="tiny-qwen2", seq_len=64, block_size=2)
    result = parity(cfg, steps=1, store=store, mutate=flip, verify_initial=False)
    assert result.parity == "FAIL" and result.first_mismatch == "step0.micro0.loss"


def test_recorded_reference_gate_passes_for_any_schedule_and_fails_for_other_arithmetic(stores):
    """The gate against resident states recorded in host memory (for plans that cannot share the device
    with resident): every schedule PASSes; a trainer computing something else (lr) FAILs."""
    from poros.engine.methods.executor import PorosTrainer
    from poros.engine.verify.parity import RecordedReference, run_gate_recorded
    from poros.engine.methods.trainer import ResidentTrainer

    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, grad_accum=2, lr=1e-2)
    reference = RecordedReference(ResidentTrainer(store, cfg), 2)
    for schedule in ({}, {"vram_budget": "1GB"}, {"block_size": 1, "accumulation": "micro"}):
        result = run_gate_recorded(reference, PorosTrainer(store, cfg.replace(**schedule)))
        assert result.ok and result.steps == 2 and result.gate == "resident (recorded)", (schedule, result.first_mismatch)
    other = run_gate_recorded(reference, PorosTrainer(store, cfg.replace(lr=2e-2)))
    assert other.parity == "FAIL" and other.first_mismatch.startswith("step0.weight:"), other.first_mismatch


def test_a_reset_trainer_trains_as_a_fresh_one(stores):
    """`Trainer.reset_to(init)` (the sweep's control and timing reuse the reference's trainer): after two
    steps and a reset, the gate against the recorded fresh run PASSes; reset to other weights, it FAILs."""
    from poros.config import Method
    from poros.engine.methods.registry import make_trainer
    from poros.engine.verify.parity import RecordedReference, run_gate_recorded

    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, grad_accum=2, lr=1e-2)
    trainer = make_trainer(Method.RESIDENT, store, cfg)
    reference = RecordedReference(trainer, 2)
    trainer.reset_to(reference.init)
    assert run_gate_recorded(reference, trainer).ok
    trainer.reset_to({k: v + 1e-3 if "lora_A" in k else v for k, v in reference.init.items()})
    result = run_gate_recorded(reference, trainer)
    assert not result.ok and result.first_mismatch.startswith("init:")
