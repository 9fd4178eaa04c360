"""Long-context pieces on the GPU, under strict deterministic algorithms on the flash path.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 pytest -m gpu tests/engine/test_gpu_long.py -s
    POROS_GPU_TEST_MODEL=qwen3-32b POROS_GPU_TEST_SEQ=2048 CUBLAS_WORKSPACE_CONFIG=:4096:8 \
        pytest -m gpu tests/engine/test_gpu_long.py -s

Each pair is gated (torch.equal on every tensor) and prints its JSON line: resident_gc against resident
(gradient checkpointing is exact here), poros against resident_gc (the long-context gate), and resident
with `loss_chunk` against resident with the model's own loss (whether the chunked head is bitwise the
model's loss on this GPU, as on the CPU). POROS_GPU_TEST_ATTENTION picks the backend (default flash).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tests.capabilities import requires_gpu

MODELS = [m.strip() for m in os.environ.get("POROS_GPU_TEST_MODEL", "tiny-qwen3").split(",") if m.strip()]
SEQ = int(os.environ.get("POROS_GPU_TEST_SEQ", "512"))
STEPS = int(os.environ.get("POROS_GPU_TEST_STEPS", "2"))
ATTN = os.environ.get("POROS_GPU_TEST_ATTENTION", "flash")
# (reference, method, what the method's config changes)
PAIRS = [("resident", "resident_gc", {}), ("resident_gc", "poros", {"cuda_graphs": True}),
         ("resident", "resident", {"loss_chunk": max(SEQ // 4, 1)})]


@pytest.mark.gpu
@requires_gpu(1)
@pytest.mark.parametrize("reference,method,change", PAIRS,
                         ids=[f"{m}-vs-{r}" + "".join(f"-{k}={v}" for k, v in c.items()) for r, m, c in PAIRS])
@pytest.mark.parametrize("model", MODELS, ids=[f"model={m}" for m in MODELS])
def test_gpu_long_context_gate(model, reference, method, change):
    from poros.store.build import build_store
    from poros.config import Method, TrainConfig
    from poros.engine.methods.registry import make_trainer
    from poros.engine.verify.parity import RecordedReference, run_gate_recorded

    cfg = TrainConfig(model=model, seq_len=SEQ, block_size=4, device="cuda", attention=ATTN, deterministic=True)
    store, _ = build_store(model, device="cuda")
    ref = make_trainer(Method(reference), store, cfg)
    recorded = RecordedReference(ref, STEPS)  # one after the other: at long context both would not fit
    ref.close()
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    mine = make_trainer(Method(method), store, cfg.replace(**change))
    result = run_gate_recorded(recorded, mine)
    print(result.json(), f"peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB")
    mine.close()
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert result.ok, f"{model}: first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"
