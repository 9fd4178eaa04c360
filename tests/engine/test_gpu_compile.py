"""Compiled decoder layers (`compile`) on the GPU: poros against resident QLoRA, both compiled, under strict
deterministic algorithms and inductor's deterministic mode.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 pytest -m gpu tests/engine/test_gpu_compile.py -s
    POROS_GPU_TEST_MODEL=qwen2.5-72b POROS_GPU_TEST_SEQ=512 CUBLAS_WORKSPACE_CONFIG=:4096:8 \
        pytest -m gpu tests/engine/test_gpu_compile.py -s -k real

Every tiny family (seq 64 by default) is gated eagerly-scheduled and with `cuda_graphs` (layer templates that
capture the compiled layers), and resident_gc against resident; POROS_GPU_TEST_MODEL (registry names or
checkpoint folders, comma-separated) adds real shapes. Negative controls: poros's first forward through the
inference graph FAILs, and eager resident differs from compiled resident. Each gate prints its JSON line.
POROS_GPU_TEST_ATTENTION picks the backend (default fast).
"""

from __future__ import annotations

import os

import pytest
import torch

from poros.engine.methods.trainer import set_cublas_workspace
from tests.capabilities import requires_gpu

set_cublas_workspace()  # before anything touches CUDA: repeatable matmuls under strict determinism

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]
REAL = [m.strip() for m in os.environ.get("POROS_GPU_TEST_MODEL", "").split(",") if m.strip()]
SEQ = int(os.environ.get("POROS_GPU_TEST_SEQ", "512"))
TINY_SEQ = 64
STEPS = int(os.environ.get("POROS_GPU_TEST_STEPS", "2"))
ATTN = os.environ.get("POROS_GPU_TEST_ATTENTION", "fast")


pytestmark = pytest.mark.usefixtures("fresh_compile_caches")  # tests/engine/conftest.py


def _cfg(model: str, seq: int, **settings):
    from poros.config import TrainConfig

    base = dict(block_size=2, device="cuda", attention=ATTN, deterministic=True, compile=True, lr=1e-2)
    return TrainConfig(model=model, seq_len=seq, **{**base, **settings})


def _store(model: str):
    from poros.store.build import build_store

    return build_store(model, seed=0, device="cuda", progress=False)[0]


def _why(result) -> str:
    return f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"


@pytest.mark.gpu
@requires_gpu(1)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager-schedule", "cuda_graphs"])
@pytest.mark.parametrize("model", TINY, ids=[f"model={m}" for m in TINY])
def test_gpu_compiled_gate_tiny(model, graphs):
    from poros.engine.methods.executor import PorosTrainer
    from poros.engine.verify.parity import run_gate
    from poros.engine.methods.trainer import ResidentTrainer

    store = _store(model)
    cfg = _cfg(model, TINY_SEQ, grad_accum=2, cuda_graphs=graphs)
    resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg)
    result = run_gate(resident, poros, STEPS)
    print(result.json(), poros.counters())
    assert result.ok, f"{model}: {_why(result)}"
    if graphs:  # the templates captured the compiled layers (all but the first, not templated when compiled)
        c = poros.counters()
        assert c["capture_errors"] == 0 and c["graphs_captured"] > 0, poros.templates.errors()
    resident.close()
    poros.close()


@pytest.mark.gpu
@requires_gpu(1)
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma3"], ids=lambda m: f"model={m}")
def test_gpu_compiled_resident_gc_matches_compiled_resident(model):
    from poros.config import Method
    from poros.engine.verify.parity import parity

    result = parity(_cfg(model, TINY_SEQ), steps=STEPS, store=_store(model), method=Method.RESIDENT_GC)
    print(result.json())
    assert result.ok, f"{model}: {_why(result)}"


@pytest.mark.gpu
@requires_gpu(1)
def test_gpu_inference_graph_forward_fails_the_gate(monkeypatch):
    """Negative control: poros's first forward without autograd (the inference graph) differs."""
    from poros.engine.runtime import runners
    from poros.engine.verify.parity import parity

    def inference_forward(self, key, x, call):
        with torch.no_grad():
            return runners.hidden_of(call(self.layers[key[0]], x))

    monkeypatch.setattr(runners.Recompute, "_forward", inference_forward)
    result = parity(_cfg("tiny-qwen3", TINY_SEQ), steps=1, store=_store("tiny-qwen3"))
    print(result.json())
    assert result.parity == "FAIL", "the inference graph computed the training graph's bits"


@pytest.mark.gpu
@requires_gpu(1)
def test_gpu_compiled_differs_from_eager():
    """Negative control: a compiled run is gated against a compiled reference, not an eager one."""
    from poros.engine.verify.parity import run_gate
    from poros.engine.methods.trainer import ResidentTrainer

    store, cfg = _store("tiny-qwen3"), _cfg("tiny-qwen3", TINY_SEQ)
    result = run_gate(ResidentTrainer(store, cfg.replace(compile=False)), ResidentTrainer(store, cfg), 1)
    print(result.json())
    assert result.parity == "FAIL", "compiled layers computed eager bits"


@pytest.mark.gpu
@requires_gpu(1)
@pytest.mark.skipif(not REAL, reason="set POROS_GPU_TEST_MODEL to gate a real shape")
@pytest.mark.parametrize("model", REAL or ["none"], ids=[f"real-model={m}" for m in REAL or ["none"]])
def test_gpu_compiled_gate_real(model):
    from poros.store.build import build_store
    from poros.engine.verify.parity import parity

    store, stats = build_store(model, device="cuda")
    print(f"\nbuild {model}: {stats.seconds:.1f} s, NF4 store {stats.store_bytes / 1e9:.2f} GB")
    result = parity(_cfg(model, SEQ, block_size=4), steps=STEPS, store=store)
    print(result.json())
    assert result.ok, f"{model}: {_why(result)}"


@pytest.mark.gpu
@requires_gpu(1)
@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-gemma3"], ids=lambda m: f"model={m}")
def test_gpu_compiled_layers_with_an_eager_mlp_gate(model):
    """compile_mlp off with a chunked MLP: poros (its recompute deferring qwen's MLP chunks) and resident_gc against
    compiled resident; gemma3's MLP, whose output its post-feedforward norm reads, is not deferred."""
    from poros.config import Method
    from poros.engine.verify.parity import parity

    cfg, store = _cfg(model, TINY_SEQ, grad_accum=2, mlp_chunk=32, compile_mlp=False), _store(model)
    for method in (Method.POROS, Method.RESIDENT_GC):
        result = parity(cfg, steps=STEPS, store=store, method=method)
        print(method.value, result.json())
        assert result.ok, f"{model} {method.value}: {_why(result)}"
