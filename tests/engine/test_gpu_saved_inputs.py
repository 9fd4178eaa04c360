"""Saved inputs split between the device and host memory, on the GPU: copies out on a stream of their own and
back on the weights' copy stream, the host arena page-locked in place; bitwise resident QLoRA at every split,
eager and with CUDA-graph layers, each step moving the plan's bytes; resident_gc_offload bitwise resident_gc, and
poros's split bitwise resident_gc_offload; a plan that offloads over an input not fetched yet FAILs.

    pytest -m gpu tests/engine/test_gpu_saved_inputs.py -s

POROS_GPU_TEST_SEQ sets the tokens per sequence (default 1024: copies long enough to overlap compute).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from tests.capabilities import requires_gpu

SEQ = int(os.environ.get("POROS_GPU_TEST_SEQ", "1024"))
ATTN = "math"  # repeatable attention backward (tests/engine/test_gpu_parity.py)
_STORES: dict = {}

pytestmark = [pytest.mark.gpu, requires_gpu(1)]


def _store(model: str):
    from poros.store.build import build_store

    if model not in _STORES:
        _STORES[model] = build_store(model, device="cuda", progress=False)[0]
    return _STORES[model]


def _cfg(model: str, **kw):
    from poros.config import TrainConfig

    return TrainConfig(model=model, seq_len=SEQ, block_size=2, grad_accum=3, lr=1e-2, device="cuda", attention=ATTN,
                       **kw)


def _gate(reference, method, steps=2):
    from poros.engine.verify.parity import run_gate

    try:
        return run_gate(reference, method, steps)
    finally:
        reference.close()
        method.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
@pytest.mark.parametrize("k", [0, 2, 5], ids=lambda k: f"device_inputs={k}")
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma4"], ids=lambda m: f"model={m}")
def test_gpu_split_keeps_parity_and_moves_what_the_plan_says(model, k, graphs):
    from poros.engine.methods.executor import PorosTrainer
    from poros.engine.methods.trainer import ResidentTrainer

    cfg = _cfg(model, offload_inputs=True, device_inputs=k, cuda_graphs=graphs)
    poros = PorosTrainer(_store(model), cfg)
    try:
        plan, arena = poros.plan, poros.saved.arena
        assert plan.host_inputs == tuple(range(5 - k))
        # the copies back take the weights' copy stream, in the plan's order among its loads (saved_inputs.py)
        assert k == 5 or poros.saved.h2d is poros.buffers.copy_stream
        assert (arena is None) == (k == 5) and (arena is None or arena.pinned)
        for _ in range(2):
            c = poros.step().counters
            assert c.get("input_bytes_d2h", 0) == c.get("input_bytes_h2d", 0) == plan.d2h_bytes_per_step
            assert c["bytes_h2d"] == plan.h2d_bytes_per_step
    finally:
        poros.close()
    result = _gate(ResidentTrainer(_store(model), cfg), PorosTrainer(_store(model), cfg))
    print(result.json())
    assert result.ok, f"{model} K={k} graphs={graphs}: first mismatch {result.first_mismatch}"


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma4"], ids=lambda m: f"model={m}")
def test_gpu_resident_gc_offload_is_resident_gc_and_gates_a_split(model):
    from poros.config import Method
    from poros.engine.methods.registry import make_trainer
    from poros.engine.verify.parity import parity

    cfg = _cfg(model, offload_inputs=True, device_inputs=2)
    result = _gate(make_trainer(Method.RESIDENT_GC, _store(model), cfg),
                   make_trainer(Method.RESIDENT_GC_OFFLOAD, _store(model), cfg))
    print(result.json())
    assert result.ok, f"{model}: resident_gc_offload differs from resident_gc at {result.first_mismatch}"
    gc_offload = make_trainer(Method.RESIDENT_GC_OFFLOAD, _store(model), cfg)
    try:
        c = gc_offload.step().counters
        assert c["saved_bytes_d2h"] == c["saved_bytes_h2d"] > 0
    finally:
        gc_offload.close()
    result = parity(cfg, steps=2, store=_store(model), reference=Method.RESIDENT_GC_OFFLOAD, sequential=True)
    print(result.json())
    assert result.ok and result.gate == "resident_gc_offload (recorded)", result.first_mismatch


def test_gpu_an_offload_over_an_input_not_fetched_yet_fails():
    """Negative control on the device: two micro-batches' inputs of a layer through one slot."""
    from poros.engine.methods.executor import PorosTrainer, geometry_of_store
    from poros.engine.planning import plan as P
    from poros.engine.planning.search import build_plan
    from poros.engine.methods.trainer import ResidentTrainer
    from tests.plans import plan_request

    cfg = _cfg("tiny-qwen3", offload_inputs=True, device_inputs=2)
    good = build_plan(geometry_of_store(_store("tiny-qwen3"), cfg), plan_request(cfg))
    bad = replace(good, step=tuple(replace(op, buffer=op.buffer - op.buffer % 3) if op.kind in (P.OFFLOAD, P.FETCH)
                                   else op for op in good.step))
    result = _gate(ResidentTrainer(_store("tiny-qwen3"), cfg),
                   PorosTrainer(_store("tiny-qwen3"), cfg, plan=bad, check_plan=False), steps=1)
    print(result.json())
    assert not result.ok and result.first_mismatch is not None
