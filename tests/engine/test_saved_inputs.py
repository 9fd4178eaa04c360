"""Saved inputs split between the device and host memory, run (poros/engine/runtime/saved_inputs.py): bitwise equal to
resident QLoRA and to resident_gc at every split, the placement honored (the bytes each way per step are the
plan's, and the host arena is the plan's size), and plans that break it caught: by the counters, by the
rules, and by the gate when run anyway."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from poros.config import Method, TrainConfig
from poros.engine.methods.executor import PorosTrainer
from poros.engine.methods.registry import make_trainer
from poros.engine.verify.parity import run_gate
from poros.engine.planning import plan as P
from poros.engine.runtime.saved_inputs import HostArena
from poros.errors import CapabilityError
from tests.engine.test_executor import gate, plan_for

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]


def config(model: str, **kw) -> TrainConfig:
    return TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=2, lr=1e-2, **kw)


def moved_as_planned(plan: P.Plan, counters: dict) -> bool:
    """Whether a step's counters are the plan's bytes: its saved inputs each way, and all it copied host->device."""
    return (counters["input_bytes_d2h"] == counters["input_bytes_h2d"] == plan.d2h_bytes_per_step
            and counters["bytes_h2d"] == plan.h2d_bytes_per_step)


@pytest.mark.parametrize("k", [0, 1, 3, 5], ids=lambda k: f"device_inputs={k}")
@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_a_split_is_bitwise_resident_and_moves_what_the_plan_says(stores, model, k):
    """K = 0 (every input through host memory), some, and all 5 layers' on the device: torch.equal to resident
    QLoRA over 2 steps; each step moves exactly the plan's bytes each way."""
    cfg = config(model, offload_inputs=True, device_inputs=k)
    store = stores(model)
    result, counters = gate(store, cfg)
    assert result.ok, result.first_mismatch
    trainer = PorosTrainer(store, cfg)
    try:
        assert trainer.plan.host_inputs == tuple(range(5 - k))
        for _ in range(2):
            c = trainer.step().counters
            assert c.get("input_bytes_d2h", 0) == trainer.plan.d2h_bytes_per_step == (5 - k) * 2 * 64 * \
                store.config.hidden_size * 2
            assert k == 5 or moved_as_planned(trainer.plan, c)
        arena = trainer.saved.arena
        assert (arena is None) == (k == 5)
        assert arena is None or arena.bytes.numel() == trainer.plan.host_input_bytes == trainer.plan.host_slots * \
            trainer.plan.input_slot
    finally:
        trainer.close()


@pytest.mark.parametrize("k", [0, 2, 5], ids=lambda k: f"device_inputs={k}")
def test_a_split_is_bitwise_resident_gc(stores, k):
    cfg = config("tiny-gemma3", offload_inputs=True, device_inputs=k)
    store = stores("tiny-gemma3")
    result = run_gate(make_trainer(Method.RESIDENT_GC, store, cfg), make_trainer(Method.POROS, store, cfg), steps=2)
    assert result.ok and result.gate == "resident_gc", result.first_mismatch


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma4"], ids=lambda m: f"model={m}")
def test_a_split_with_kept_attention_and_micro_order(stores, model):
    """Each slot holds an input and its attention's results; micro-major, one slot a layer serves every
    micro-batch in turn."""
    cfg = config(model, offload_inputs=True, device_inputs=2, keep_attention=True, accumulation="micro")
    result, c = gate(stores(model), cfg)
    assert result.ok, result.first_mismatch
    assert c["input_bytes_d2h"] == c["input_bytes_h2d"] > 3 * 2 * 64 * stores(model).config.hidden_size * 2


def test_a_plan_that_moves_less_than_it_places_is_caught_by_the_counters(stores):
    """Negative control for the counters: a plan whose moves of one host-held layer are dropped (refused by
    the rules, run anyway) trains the same bits, but moves fewer bytes than the plan says."""
    cfg = config("tiny-qwen2", offload_inputs=True, device_inputs=2)
    store = stores("tiny-qwen2")
    good = plan_for(store, cfg)
    bad = replace(good, step=tuple(op for op in good.step if not (op.kind in (P.OFFLOAD, P.FETCH) and op.layer == 0)))
    with pytest.raises(CapabilityError, match="never offloaded"):
        PorosTrainer(store, cfg, plan=bad)
    result, _ = gate(store, cfg, plan=bad, check_plan=False)
    assert result.ok  # the bits cannot tell
    for plan, moved in ((good, True), (bad, False)):
        trainer = PorosTrainer(store, cfg, plan=plan, check_plan=False)
        try:
            c = trainer.step().counters
        finally:
            trainer.close()
        assert moved_as_planned(plan, c) is moved
        assert c["input_bytes_d2h"] == (good.d2h_bytes_per_step if moved else good.d2h_bytes_per_step * 2 // 3)


def test_an_offload_over_an_input_not_fetched_yet_fails_the_gate(stores):
    """Negative control for the slots: both micro-batches of a layer offloaded into one slot. Refused; run
    anyway, the first micro-batch's backward reads the second one's input, and the gate FAILs."""
    cfg = config("tiny-qwen2", offload_inputs=True, device_inputs=2)
    store = stores("tiny-qwen2")
    good = plan_for(store, cfg)
    ops = tuple(replace(op, buffer=op.buffer - op.buffer % 2) if op.kind in (P.OFFLOAD, P.FETCH) else op
                for op in good.step)
    bad = replace(good, step=ops)
    with pytest.raises(CapabilityError, match="overwrites slot"):
        PorosTrainer(store, cfg, plan=bad)
    result, _ = gate(store, cfg, plan=bad, check_plan=False)
    assert result.parity == "FAIL" and ".grad:" in result.first_mismatch, result.first_mismatch


def test_a_backward_before_its_fetch_is_refused_and_stops_when_run(stores):
    cfg = config("tiny-qwen2", offload_inputs=True)
    store = stores("tiny-qwen2")
    good = plan_for(store, cfg)
    bad = replace(good, step=tuple(op for op in good.step if not (op.kind == P.FETCH and op.layer == 2)))
    with pytest.raises(CapabilityError, match="before its saved input is fetched"):
        PorosTrainer(store, cfg, plan=bad)
    trainer = PorosTrainer(store, cfg, plan=bad, check_plan=False)
    try:
        with pytest.raises(AssertionError, match="layer 2, micro-batch 0 is in host memory"):
            trainer.step()
    finally:
        trainer.close()


def test_the_arena_lays_tensors_out_as_planned():
    """Views keep each tensor's shape and layout (a transposed one too), aligned one after another; a tensor
    larger than its slot is refused."""
    arena = HostArena(slots=2, slot_bytes=2 * 256 + 512, pin=False)
    x = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).transpose(1, 2)
    views = arena.views(1, (x, t))
    for v, src in zip(views, (x, t)):
        v.copy_(src)
        assert torch.equal(v, src) and v.stride() == torch.empty_like(src).stride()
    assert views[0].data_ptr() - arena.bytes.data_ptr() == 1024 and views[1].data_ptr() - views[0].data_ptr() == 256
    with pytest.raises(CapabilityError, match="does not fit its host slot"):
        arena.views(0, (torch.zeros(300, dtype=torch.float32),))


def test_host_memory_is_measured_for_cuda_runs_and_shared_among_a_hosts_ranks(monkeypatch):
    """`host_budget: auto` on CUDA: what the host has left and the built store; data-parallel ranks each plan
    for their share of the least any rank found (the same plan on every rank); a size, or the CPU, measures
    nothing."""
    from poros.engine.runtime import saved_inputs
    from poros.engine.parallel.distributed import World
    from poros.engine.planning.inputs import HostMemory

    monkeypatch.setattr(saved_inputs, "available_host_memory", lambda: 100 * 10**9)
    cuda = TrainConfig(model="m", device="cuda")
    assert saved_inputs.host_memory(cuda, World(), 40) == HostMemory(100 * 10**9, held=40)
    assert saved_inputs.host_memory(cuda.replace(host_budget="90GB"), World(), 40) is None
    assert saved_inputs.host_memory(TrainConfig(model="m"), World(), 40) is None
    seen = []
    monkeypatch.setattr(saved_inputs, "largest", lambda v, world: seen.append(v) or max(v, -80e9))  # another rank: 80 GB
    two = World(rank=1, size=2, local_rank=1, local_size=2)
    assert saved_inputs.host_memory(cuda, two, 40) == HostMemory(40 * 10**9, held=40) and seen == [-100e9]
    monkeypatch.setattr(saved_inputs, "available_host_memory", lambda: None)  # this rank cannot read /proc/meminfo
    assert saved_inputs.host_memory(cuda, two, 40) == HostMemory(40 * 10**9, held=40)
