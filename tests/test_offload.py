"""Activation offload: layers that keep their forward graph, saved tensors in host memory, skip the
recompute and still give bitwise parity; corrupting what comes back from the host fails the gate."""

from __future__ import annotations

import pytest

from poros.build import build_store
from poros.config import TrainConfig
from poros.errors import ConfigError
from poros.matrix import parse_matrix
from poros.offload import offloaded_layers
from poros.parity import run_gate
from poros.residency import PorosTrainer
from poros.train import ResidentTrainer

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]


@pytest.fixture(autouse=True)
def offload_small_tensors(monkeypatch):
    monkeypatch.setattr("poros.offload.MIN_BYTES", 0)  # tiny models: every saved tensor is small


def test_offloaded_layers_are_spread_and_skip_the_last_block():
    assert offloaded_layers(64, 60, 0.0) == frozenset()
    half = offloaded_layers(64, 60, 0.5)
    assert len(half) == 30 and all(i < 60 for i in half) and sorted(half)[:3] == [1, 3, 5]
    assert offloaded_layers(80, 76, 0.25) == frozenset(range(3, 76, 4))
    assert offloaded_layers(5, 4, 1.0) == frozenset(range(4))


def _gate(model, fraction, grad_accum, steps=2, corrupt=False):
    store, _ = build_store(model, seed=0, device="cpu", progress=False)
    cfg = TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=grad_accum, lr=1e-2,
                      activation_offload=fraction)
    resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg)
    recomputed = []
    original = poros._recompute
    poros._recompute = lambda i: (recomputed.append(i), original(i))[1]
    if corrupt:  # what comes back from the host is not what went out: flip a bit in every byte
        prefetch = poros.offloader.prefetch

        def bad_prefetch(layer):
            for entry in poros.offloader.layers.get(layer, {}).values():
                if entry.device is None:
                    entry.host.copy_(entry.host ^ 0x04)
            prefetch(layer)

        poros.offloader.prefetch = bad_prefetch
    return run_gate(resident, poros, steps), poros, recomputed


@pytest.mark.parametrize("grad_accum", [1, 2], ids=lambda g: f"accum={g}")
@pytest.mark.parametrize("fraction", [0.5, 1.0], ids=lambda f: f"offload={f}")
@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_offload_keeps_parity_and_skips_recompute(model, fraction, grad_accum):
    result, poros, recomputed = _gate(model, fraction, grad_accum)
    assert result.ok, f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"
    n = len(poros.store.layers)
    assert poros.offload_layers and set(recomputed).isdisjoint(poros.offload_layers)
    assert len(recomputed) == 2 * grad_accum * (n - len(poros.offload_layers))  # 2 steps
    c = poros.counters()
    assert c["act_bytes_d2h"] > 0 and c["act_bytes_h2d"] == c["act_bytes_d2h"]  # all of it came back
    assert not poros.offloader.layers and not poros._graphs  # nothing left over after the step


def test_corrupted_offloaded_activations_fail_on_gradients():
    """Negative control: the loss (forward) stays exact, the gradients do not."""
    result, _, _ = _gate("tiny-qwen3", 1.0, 1, steps=1, corrupt=True)
    assert result.parity == "FAIL"
    assert result.first_mismatch.startswith("step0.grad:"), result.first_mismatch


def test_offload_fraction_is_validated():
    with pytest.raises(ConfigError, match="activation_offload"):
        TrainConfig(model="tiny-qwen3", activation_offload=1.5)
    base = {"name": "t", "steps": 1, "passes": 1, "seq_len": 64, "batch_size": 1, "grad_accum": 1, "lora_rank": 4,
            "lora_alpha": 8, "block_size": 2, "dataset": "synthetic", "methods": ["poros"], "models": ["tiny-qwen3"],
            "stacks": ["current"]}
    assert parse_matrix({**base, "activation_offload": 0.25}).activation_offload == 0.25
    with pytest.raises(ConfigError, match="activation_offload"):
        parse_matrix({**base, "activation_offload": "half"})
