"""Kept attention (`keep_attention`) on the GPU: flash and memory-efficient attention, eager and compiled
layers, poros against resident QLoRA under strict deterministic algorithms.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 pytest -m gpu tests/engine/test_gpu_kept_attention.py -s

Every tiny family at 128 tokens (gemma3's sliding-window layers take memory-efficient attention, the others
flash), saved inputs on the device and in host memory. Each recompute must take every fused call from its
forward (`attention_replayed`); the negative control changes one kept value and must FAIL.
"""

from __future__ import annotations


import pytest

from poros.engine.methods.trainer import set_cublas_workspace
from tests.capabilities import requires_gpu

set_cublas_workspace()  # before anything touches CUDA: repeatable matmuls under strict determinism

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]
SEQ = 128


pytestmark = pytest.mark.usefixtures("fresh_compile_caches")  # tests/engine/conftest.py


def _gate(model: str, **settings):
    from poros.config import TrainConfig
    from poros.engine.methods.executor import PorosTrainer
    from poros.engine.verify.parity import run_gate
    from poros.engine.methods.trainer import ResidentTrainer
    from poros.store.build import build_store

    store = build_store(model, seed=0, device="cuda", progress=False)[0]
    cfg = TrainConfig(model=model, seq_len=SEQ, block_size=2, grad_accum=2, device="cuda", attention="fast",
                      deterministic=True, lr=1e-2, keep_attention=True, **settings)
    resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg)
    try:
        result = run_gate(resident, poros, 2)
        counters = poros.counters()
    finally:
        resident.close()
        poros.close()
    print(model, settings, result.json(), counters)
    return result, counters, len(store.layers)


@pytest.mark.gpu
@requires_gpu(1)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("offload", [False, True], ids=["inputs on device", "inputs in host memory"])
@pytest.mark.parametrize("model", TINY, ids=[f"model={m}" for m in TINY])
def test_gpu_kept_attention_keeps_parity(model, offload, compiled):
    result, c, layers = _gate(model, offload_inputs=offload, compile=compiled)
    assert result.ok, f"{model}: first mismatch {result.first_mismatch}"
    assert c["attention_replayed"] == layers * 2 * 2 and c["attention_computed"] == 0, c


@pytest.mark.gpu
@requires_gpu(1)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_a_changed_kept_output_fails(monkeypatch, compiled):
    from tests.faults import change_kept_attention_output

    change_kept_attention_output(monkeypatch)
    result, _, _ = _gate("tiny-qwen2", compile=compiled)
    assert not result.ok
