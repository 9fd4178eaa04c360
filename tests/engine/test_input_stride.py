"""Strided saved inputs (`input_stride`, poros/engine/planning/regen.py), planned and run: bitwise equal to
resident QLoRA and resident_gc on every tiny family, beside host-held inputs and chunked MLPs; the counters are the
plan's; and plans that regenerate wrongly are refused by the rules, or FAIL the gate when run anyway."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poros.config import Method, TrainConfig
from poros.engine.methods.executor import PorosTrainer
from poros.engine.methods.registry import make_trainer
from poros.engine.verify.parity import run_gate
from poros.engine.planning import plan as P
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.plan import describe
from poros.engine.planning.rules import check
from poros.engine.planning.search import PlanRequest, build_plan
from poros.engine.runtime.runners import Recompute
from poros.errors import CapabilityError, ConfigError
from poros.models.checkpoint import resolve
from tests.engine.test_executor import gate, plan_for

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]


def config(model: str, **kw) -> TrainConfig:
    return TrainConfig(model=model, seq_len=64, **{"block_size": 2, "grad_accum": 2, "lr": 1e-2, **kw})


def as_planned(plan: P.Plan, c: dict) -> None:
    """A step's counters are the plan's: weights and inputs host->device, loads, regenerations, inputs out."""
    assert c["bytes_h2d"] == plan.h2d_bytes_per_step
    assert c["block_copies"] == plan.loads_per_step
    assert c["regenerations"] == plan.regenerations_per_step == len(plan.regenerated) * plan.grad_accum > 0
    assert c.get("input_bytes_d2h", 0) == plan.d2h_bytes_per_step


@pytest.mark.parametrize("stride", [2, 3], ids=lambda s: f"stride={s}")
@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_strided_inputs_are_bitwise_resident(stores, model, stride):
    """5 layers in blocks of 2: stride 2 regenerates layers 1 and 3, stride 3 layers 1, 2 and 4 (a segment reaches
    the block prefetched below its top, no further). torch.equal to resident over 2 steps; counters as planned."""
    cfg = config(model, input_stride=stride)
    store = stores(model)
    result, _ = gate(store, cfg)
    assert result.ok, result.first_mismatch
    trainer = PorosTrainer(store, cfg)
    try:
        assert trainer.plan.regenerated == ((1, 3) if stride == 2 else (1, 2, 4))
        for _ in range(2):
            as_planned(trainer.plan, trainer.step().counters)
    finally:
        trainer.close()


@pytest.mark.parametrize("k", [0, 1], ids=lambda k: f"device_inputs={k}")
@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_strided_inputs_through_host_memory_are_bitwise_resident(stores, model, k):
    """Beside a device/host split: only saved inputs go through host memory, the regenerations read them back."""
    cfg = config(model, input_stride=2, offload_inputs=True, device_inputs=k)
    store = stores(model)
    result, _ = gate(store, cfg)
    assert result.ok, result.first_mismatch
    trainer = PorosTrainer(store, cfg)
    try:
        saved = [i for i in range(5) if i not in trainer.plan.regenerated]
        assert trainer.plan.host_inputs == tuple(saved[: len(saved) - k])
        for _ in range(2):
            as_planned(trainer.plan, trainer.step().counters)
    finally:
        trainer.close()


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-gemma4"], ids=lambda m: f"model={m}")
def test_strided_inputs_with_chunks_layer_major_and_dropout_are_bitwise_resident(stores, model):
    """mlp_chunk and attention_chunk (checkpointed chunks in the recompute), layer-major accumulation (both
    micro-batches' inputs regenerated at once) and LoRA dropout (the regeneration draws the forward's masks)."""
    cfg = config(model, input_stride=3, block_size=1, mlp_chunk=16, attention_chunk=16, accumulation="layer",
                 lora_dropout=0.1)
    store = stores(model)
    result, counters = gate(store, cfg)
    assert result.ok, result.first_mismatch
    assert counters["regenerations"] > 0


@pytest.mark.parametrize("stride", [2, 3], ids=lambda s: f"stride={s}")
def test_strided_inputs_are_bitwise_resident_gc(stores, stride):
    cfg = config("tiny-qwen3", input_stride=stride, offload_inputs=True, device_inputs=1)
    store = stores("tiny-qwen3")
    ref, poros = make_trainer(Method.RESIDENT_GC, store, cfg), PorosTrainer(store, cfg)
    try:
        result = run_gate(ref, poros, 2)
    finally:
        ref.close()
        poros.close()
    assert result.ok, result.first_mismatch


def test_a_regeneration_that_skips_the_layer_fails_the_gate(stores, monkeypatch):
    """Negative control for the gate: the regenerated input of layer j + 1 taken from the wrong layer (layer j's
    own input, its forward skipped) FAILs it."""
    monkeypatch.setattr(Recompute, "regenerate", lambda self, key: self.saved.peek(key)[0].clone())
    result, _ = gate(stores("tiny-qwen2"), config("tiny-qwen2", input_stride=2))
    assert result.parity == "FAIL", result.first_mismatch


def _plan(store, **kw) -> P.Plan:
    cfg = config("tiny-qwen2", **kw)
    return plan_for(store, cfg)


def _refused(store, plan: P.Plan, match: str, **kw) -> None:
    problems = check(plan)
    assert any(match in p for p in problems), problems
    with pytest.raises(CapabilityError, match="refusing an unsafe plan"):
        PorosTrainer(store, config("tiny-qwen2", **kw), plan=plan)


def test_a_plan_without_its_regenerations_is_refused_and_stops_when_run(stores):
    store = stores("tiny-qwen2")
    good = _plan(store, input_stride=2)
    assert not check(good)
    bad = replace(good, step=tuple(op for op in good.step if op.kind != P.REGEN))
    _refused(store, bad, "before its input is regenerated", input_stride=2)
    trainer = PorosTrainer(store, config("tiny-qwen2", input_stride=2), plan=bad, check_plan=False)
    try:
        with pytest.raises(KeyError):
            trainer.step()
    finally:
        trainer.close()


def test_a_regeneration_from_the_wrong_layer_is_refused(stores):
    """Each regeneration of layer j's forward moved to layer j + 1's: it would make layer j + 2's input, which the
    plan saves, from layer j + 1's, which was never saved; layer j + 1 finds its input never made."""
    store = stores("tiny-qwen2")
    good = _plan(store, input_stride=2)
    bad = replace(good, step=tuple(replace(op, layer=op.layer + 1) if op.kind == P.REGEN else op for op in good.step))
    _refused(store, bad, "which the plan does not regenerate", input_stride=2)
    assert any("is not on the device" in p for p in check(bad)) and any("before its input is regenerated" in p
                                                                        for p in check(bad))


def test_a_regeneration_without_its_weights_or_before_its_fetch_is_refused(stores):
    """A regeneration moved to the step's start runs before its forward and without its layer's weights; one
    moved ahead of its saved input's fetch reads an input still in host memory."""
    store = stores("tiny-qwen2")
    good = _plan(store, input_stride=2, block_size=1)
    regens = [op for op in good.step if op.kind == P.REGEN]
    early = replace(good, step=(regens[0], *(op for op in good.step if op is not regens[0])))
    _refused(store, early, "weights are not present", input_stride=2, block_size=1)
    assert any("before its forward" in p or "not saved" in p for p in check(early))
    hosted = _plan(store, input_stride=2, block_size=1, offload_inputs=True)
    step = list(hosted.step)
    first = next(k for k, op in enumerate(step) if op.kind == P.REGEN)
    fetch = next(k for k, op in enumerate(step[:first])
                 if op.kind == P.FETCH and (op.layer, op.micro) == (step[first].layer, step[first].micro))
    step.insert(first, step.pop(fetch))  # the fetch now right after the regeneration that reads it
    _refused(store, replace(hosted, step=tuple(step)), "not on the device (host)", input_stride=2, block_size=1,
             offload_inputs=True)


def _geometry(model: str) -> Geometry:
    return Geometry.of_config(model, resolve(model).config, TrainConfig(model=model).lora_targets, False)


def test_the_plan_saves_fewer_inputs_and_copies_no_more_weights():
    """qwen2.5-72b, every layer streamed in blocks of 1 (the layer below a top is the one prefetched: segments of
    2 whatever the stride asks): half the inputs, their bytes off the device (or the host), the same weight
    loads, one regenerated input at once; its text says so."""
    geo = _geometry("qwen2.5-72b")
    plans = {}
    for stride in (1, 2, 4):
        for offload in (False, True):
            cfg = TrainConfig(model="qwen2.5-72b", device="cuda", seq_len=4096, block_size=1, input_stride=stride,
                              offload_inputs=offload)
            plans[stride, offload] = build_plan(geo, PlanRequest(cfg))
    one, two, four = plans[1, False], plans[2, False], plans[4, False]
    assert two.regenerated == four.regenerated == tuple(range(1, 80, 2))
    assert two.regenerations_per_step == 40 and two.regenerated_alive == 1
    assert two.h2d_bytes_per_step == one.h2d_bytes_per_step and two.loads_per_step == one.loads_per_step
    assert one.memory.saved_inputs - two.memory.saved_inputs == (40 - 1) * one.input_bytes
    assert plans[2, True].host_inputs == tuple(range(0, 80, 2))
    assert plans[1, True].host_input_bytes == 2 * plans[2, True].host_input_bytes
    assert plans[1, True].d2h_bytes_per_step == 2 * plans[2, True].d2h_bytes_per_step
    assert "input stride 2: inputs saved for 40 of 80 recomputed layers, 40 regenerated" in describe(two)
    assert "input stride" not in describe(one)
    blocks = build_plan(geo, PlanRequest(TrainConfig(model="qwen2.5-72b", device="cuda", seq_len=4096, block_size=3,
                                                     input_stride=4)))
    assert blocks.regenerated_alive == 3 and len(blocks.regenerated) == 60  # segments of 4: a block and one below


@pytest.mark.parametrize("value", [0, -2, 1.5, "two"], ids=repr)
def test_bad_strides_are_refused_in_one_line_naming_the_field(value):
    with pytest.raises(ConfigError, match="input_stride") as e:
        TrainConfig(model="tiny-qwen2", input_stride=value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("other", [dict(keep_attention=True), dict(cuda_graphs=True, device="cuda")], ids=str)
def test_strides_with_settings_that_save_more_than_the_input_are_refused(other):
    with pytest.raises(ConfigError, match="input_stride"):
        TrainConfig(model="tiny-qwen2", input_stride=2, **other)
    TrainConfig(model="tiny-qwen2", input_stride=1, **other)  # the control: stride 1 takes them


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-gemma3"], ids=lambda m: f"model={m}")
def test_a_bounded_number_of_regenerated_inputs_is_bitwise_resident(stores, model):
    """regenerated_layers 1 of stride 3's (1, 2, 4): one layer's input regenerated, the rest saved, through host
    memory too; torch.equal to resident over 2 steps, counters as planned."""
    cfg = config(model, input_stride=3, regenerated_layers=1, offload_inputs=True, device_inputs=1)
    store = stores(model)
    result, _ = gate(store, cfg)
    assert result.ok, result.first_mismatch
    trainer = PorosTrainer(store, cfg)
    try:
        assert len(trainer.plan.regenerated) == 1 and not check(trainer.plan)
        for _ in range(2):
            as_planned(trainer.plan, trainer.step().counters)
    finally:
        trainer.close()


def test_thinning_keeps_segments_whose_weights_are_there():
    """Dropping a regenerated layer saves its input and starts a segment of the layers above it in its old one;
    the count is bounded, the layers spread evenly, and every plan of every bound keeps the rules."""
    from poros.engine.planning.regen import thin

    segs = [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert thin(segs, None) == thin(segs, 6) == segs
    assert thin(segs, 0) == [[i] for i in range(9)]
    assert thin(segs, 2) == [[0, 1], [2], [3], [4, 5], [6], [7], [8]]
    assert thin(segs, 3) == [[0, 1], [2, 3], [4], [5, 6], [7], [8]]
    geo = _geometry("qwen2.5-72b")
    for keep in (0, 1, 9, 39, 40, 80):
        cfg = TrainConfig(model="qwen2.5-72b", device="cuda", seq_len=4096, block_size=3, input_stride=4,
                          regenerated_layers=keep, offload_inputs=True)
        plan = build_plan(geo, PlanRequest(cfg))
        assert len(plan.regenerated) == min(keep, 60) and not check(plan)


def test_auto_regenerates_the_fewest_inputs_that_fit_the_budgets():
    """qwen2.5-72b at 65,536 tokens within 40 GB and a 120 GB host: auto regenerates a handful of inputs, not the
    forty stride 2 allows; one fewer does not fit (the control), and the plan is the search's for that bound."""
    from poros.engine.planning.budget import plan_for_budget, search_budget

    geo = _geometry("qwen2.5-72b")
    cfg = TrainConfig(model="qwen2.5-72b", device="cuda", seq_len=65536, attention="fast", deterministic=True,
                      loss_chunk=2048, mlp_chunk=2048, attention_chunk=2048, overlap_backward=False, input_stride=2,
                      regenerated_layers="auto")
    request = replace(PlanRequest.of_config(cfg), budget=40 * 10**9, host_budget=120 * 10**9)
    plan = plan_for_budget(geo, request)
    k = len(plan.regenerated)
    assert 0 < k < 40 and plan.memory.total <= 40 * 10**9 and plan.host_bytes <= 120 * 10**9
    assert search_budget(geo, replace(request, regenerated=k - 1))[0] is None
    assert plan_for_budget(geo, replace(request, config=cfg.replace(regenerated_layers=k))).regenerated == plan.regenerated


@pytest.mark.parametrize("kw", [dict(regenerated_layers=2), dict(regenerated_layers="auto")], ids=str)
def test_a_bound_on_regenerated_inputs_needs_a_stride(kw):
    with pytest.raises(ConfigError, match="regenerated_layers: .* needs input_stride above 1"):
        TrainConfig(model="tiny-qwen2", **kw)
    TrainConfig(model="tiny-qwen2", input_stride=2, **kw)  # the control


@pytest.mark.parametrize("value", [-1, 1.5, "many", 2**40], ids=repr)
def test_bad_bounds_on_regenerated_inputs_are_refused_in_one_line_naming_the_field(value):
    with pytest.raises(ConfigError, match="regenerated_layers: expected an integer >= 0.* auto or none") as e:
        TrainConfig(model="tiny-qwen2", input_stride=2, regenerated_layers=value)
    assert "\n" not in str(e.value)
