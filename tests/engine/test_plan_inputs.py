"""Saved inputs split between the device and host memory (poros/engine/planning/inputs.py): which layers' go
where, what the plan predicts they cost on the device and on the host, the offload and fetch operations the
rules hold to the placement (each rule with a plan that breaks it), and the host budget that refuses a plan."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poros.config import TrainConfig
from poros.engine.planning import plan as P
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.inputs import HostMemory, host_budget, input_ops
from poros.engine.planning.rules import check
from poros.engine.planning.search import PlanRequest, build_plan
from poros.engine.planning.budget import make_plan, plan_for_budget
from poros.errors import BudgetError, ConfigError
from poros.models.checkpoint import resolve
from poros.choices import Accumulation
from poros.settings import LORA_TARGETS
from poros.store.host_memory import MEMORY_HEADROOM, store_bytes
from poros.store.layout import align
from tests.plans import plan_request

GB = 10**9


def geometry(model: str) -> Geometry:
    return Geometry.of_config(model, resolve(model).config, LORA_TARGETS)


def device_held_peak(plan: P.Plan) -> int:
    """The most saved inputs the plan's operations keep on the device at once, walked as the executor holds
    them: saved at a recomputed layer's forward, gone at its offload, back at its fetch, freed at its backward."""
    kept, held, peak = set(plan.kept_layers), 0, 0
    for op in plan.step:
        if op.kind in (P.FORWARD, P.FETCH) and op.layer not in kept:
            held += 1
        peak = max(peak, held)
        if op.kind in (P.OFFLOAD, P.BACKWARD) and op.layer not in kept:
            held -= 1
    return peak


def moves(plan: P.Plan, kind: str) -> list[tuple[int, int]]:
    return sorted((op.layer, op.micro) for op in plan.step if op.kind == kind)


# --- placement and its costs ---------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 4, 20, 79, 80], ids=lambda k: f"device_inputs={k}")
def test_the_last_layers_keep_their_inputs_on_the_device(q72, k):
    """The last K layers' inputs stay; the rest go out once and back once per micro-batch, through exactly the
    host arena's slots; the device holds the larger of K layers' and the window's, and the layer in backward."""
    plan = build_plan(q72, plan_request(block_size=4, grad_accum=8, seq_len=4096, device_inputs=k))
    streamed = build_plan(q72, plan_request(block_size=4, grad_accum=8, seq_len=4096))
    one = 4096 * 8192 * 2
    assert plan.host_inputs == tuple(range(80 - k)) and plan.device_input_layers == list(range(80 - k, 80))
    assert plan.d2h_bytes_per_step == (80 - k) * 8 * one
    assert plan.h2d_bytes_per_step == streamed.h2d_bytes_per_step + plan.d2h_bytes_per_step
    assert moves(plan, P.OFFLOAD) == moves(plan, P.FETCH) == [(i, m) for i in range(80 - k) for m in range(8)]
    assert plan.input_slot == align(one) and plan.host_input_bytes == (80 - k) * 8 * one
    assert plan.host_bytes == q72.store_bytes + plan.host_input_bytes
    want = 80 * 8 if k == 80 else max(k * 8, 4 * 8) + 8
    assert plan.memory.saved_inputs == want * one
    assert device_held_peak(plan) <= want
    assert check(plan) == []


def test_inputs_on_the_device_up_to_the_window_cost_no_device_memory(q72):
    """Kept on the device, the last layers' inputs are consumed while the first window of inputs comes back:
    up to a window's worth of layers stay for free; past it each costs its bytes."""
    saved = {k: build_plan(q72, plan_request(block_size=4, seq_len=4096, device_inputs=k)).memory.saved_inputs
             for k in (0, 2, 4, 5, 6)}
    one = 4096 * 8192 * 2
    assert saved[0] == saved[2] == saved[4] == 5 * one
    assert saved[5] - saved[4] == saved[6] - saved[5] == one


def test_the_first_layers_on_the_device_would_need_more_than_the_plan_counts(q72):
    """Negative control for the order: the same count of layers on the device, but the first ones, with the
    moves the planner would make for them. The device then holds them all and the window coming back."""
    plan = build_plan(q72, plan_request(block_size=4, seq_len=4096, device_inputs=20))
    bare = [op for op in plan.step if op.kind not in (P.OFFLOAD, P.FETCH)]
    first = replace(plan, host_inputs=tuple(range(20, 80)), step=tuple(input_ops(bare, tuple(range(20, 80)), 1, 4)))
    assert check(first) == [] and device_held_peak(plan) <= 21 < device_held_peak(first)
    assert plan.memory.saved_inputs == 21 * 4096 * 8192 * 2


@settings(max_examples=40, deadline=None)
@given(resident=st.integers(0, 5), block=st.integers(1, 4), accum=st.integers(1, 4),
       order=st.sampled_from(list(Accumulation)), k=st.integers(0, 6), keep=st.booleans(),
       attention=st.booleans())
def test_every_split_keeps_the_rules_and_its_memory(resident, block, accum, order, k, keep, attention):
    """Any split on any plan: the rules hold, exactly the host layers' inputs move (never a kept layer's), and
    the device never holds more saved inputs than the memory model counts."""
    plan = build_plan(geometry("tiny-gemma3"), plan_request(
        block_size=block, grad_accum=accum, accumulation=order, resident_layers=resident, keep_activations=keep,
        keep_attention=attention, offload_inputs=True, device_inputs=k))
    assert check(plan) == []
    recomputed = [i for i in range(5) if i not in plan.kept_layers]
    assert plan.host_inputs == tuple(recomputed[: max(0, len(recomputed) - k)])
    keys = [(i, m) for i in plan.host_inputs for m in range(accum)]
    assert moves(plan, P.OFFLOAD) == moves(plan, P.FETCH) == keys
    assert {op.buffer for op in plan.step if op.kind == P.OFFLOAD} == set(range(plan.host_slots))
    assert device_held_peak(plan) * plan.input_bytes <= plan.memory.saved_inputs


# --- the rules, each broken ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def split():
    return build_plan(geometry("tiny-qwen2"), plan_request(block_size=2, grad_accum=2, device_inputs=2))


def _first(plan, kind, layer=None):
    return next(i for i, op in enumerate(plan.step) if op.kind == kind and (layer is None or op.layer == layer))


def _moved(plan, pos, to):
    ops = list(plan.step)
    ops.insert(to, ops.pop(pos))
    return replace(plan, step=tuple(ops))


def test_rule_no_fetch_before_the_offload(split):
    fetch = _first(split, P.FETCH)
    offload = _first(split, P.OFFLOAD, split.step[fetch].layer)
    problems = check(_moved(split, fetch, offload))
    assert any("before it was offloaded" in p for p in problems), problems


def test_rule_no_backward_before_the_fetch(split):
    fetch = _first(split, P.FETCH)
    op = split.step[fetch]
    backward = next(i for i, o in enumerate(split.step) if o.kind == P.BACKWARD and (o.layer, o.micro) == (op.layer, op.micro))
    problems = check(_moved(split, fetch, backward))  # now right after its backward
    assert any("before its saved input is fetched" in p for p in problems), problems
    problems = check(replace(split, step=split.step[:fetch] + split.step[fetch + 1:]))  # never fetched
    assert any("before its saved input is fetched" in p for p in problems), problems
    assert any("never fetched" in p for p in problems), problems


def test_rule_no_offload_over_an_input_not_fetched_yet(split):
    """Two micro-batches' inputs of one layer into one slot: the second overwrites the first before its fetch."""
    ops = [replace(op, buffer=op.buffer - op.buffer % 2) if op.kind in (P.OFFLOAD, P.FETCH) else op
           for op in split.step]
    problems = check(replace(split, step=tuple(ops)))
    assert any("overwrites slot" in p for p in problems), problems


def test_rule_the_moves_are_the_placement(split):
    """A layer the plan places on the device is not moved; one placed in host memory is."""
    problems = check(replace(split, host_inputs=split.host_inputs[1:]))
    assert any("which the plan keeps on the device" in p for p in problems), problems
    layer = split.host_inputs[0]
    unmoved = tuple(op for op in split.step if not (op.kind in (P.OFFLOAD, P.FETCH) and op.layer == layer))
    problems = check(replace(split, step=unmoved))
    assert any("placed in host memory but never offloaded" in p for p in problems), problems


def test_rule_a_kept_layer_saves_no_input_to_place():
    plan = build_plan(geometry("tiny-qwen2"), plan_request(block_size=2, resident_layers=2, keep_activations=True,
                                                           offload_inputs=True))
    assert plan.kept_layers == (3, 4) and plan.host_inputs == (0, 1, 2)
    problems = check(replace(plan, host_inputs=(0, 1, 2, 3)))
    assert any("layer 3 keeps its activations" in p for p in problems), problems


def test_the_split_plans_as_built_keep_every_rule(split):
    assert split.host_inputs == (0, 1, 2) and check(split) == []


# --- settings, search and the host budget --------------------------------------------------------

def test_device_inputs_needs_offload_inputs():
    with pytest.raises(ConfigError, match="device_inputs: .* needs offload_inputs"):
        TrainConfig(model="tiny-qwen2", device_inputs=2)
    assert TrainConfig(model="tiny-qwen2", offload_inputs=True, device_inputs=2).device_inputs == 2


def test_a_config_places_the_inputs_as_it_says(q72):
    cfg = TrainConfig(model="qwen2.5-72b", device="cuda", offload_inputs=True, device_inputs=30, host_budget=None)
    plan = make_plan(q72, cfg)
    assert plan.host_inputs == tuple(range(50)) and plan.summary()["device_inputs"] == 30
    assert plan.summary()["host_inputs"] == list(range(50)) and plan.summary()["host_bytes"] == plan.host_bytes
    text = P.describe(plan)
    assert "device for layers 50-79 (30), host memory for 0-49 (50)" in text and "host memory: NF4 store" in text


def test_host_budget_auto_is_what_the_host_has_left():
    cuda, cpu = TrainConfig(model="m", device="cuda"), TrainConfig(model="m")
    host = HostMemory(available=110 * GB, held=45 * GB)
    assert host_budget("auto", host, cuda=True) == int(110 * GB / (1 + MEMORY_HEADROOM)) + 45 * GB
    assert host_budget("auto", None, cuda=True) is None and host_budget("auto", host, cuda=False) is None
    assert host_budget(7 * GB, None, cuda=False) == 7 * GB
    assert PlanRequest.of_config(cuda, host=host).host_budget == host_budget("auto", host, True)
    assert PlanRequest.of_config(cpu, host=host).host_budget is None


def test_a_plan_beyond_the_host_budget_is_refused_in_one_line(q72):
    """72B at 16,384 tokens: every saved input in host memory is 21 GB beside the 44.5 GB store."""
    kw = dict(model="qwen2.5-72b", device="cuda", seq_len=16384, offload_inputs=True)
    fits = make_plan(q72, TrainConfig(**kw, host_budget="66GB"))
    assert fits.host_bytes <= 66 * GB
    with pytest.raises(BudgetError) as refused:
        make_plan(q72, TrainConfig(**kw, host_budget="60GB"))
    text = str(refused.value)
    assert "\n" not in text and "80 layers in host memory (21.47 GB)" in text and "more than host_budget 60 GB" in text
    assert make_plan(q72, TrainConfig(**kw, device_inputs=30, host_budget="60GB")).host_bytes <= 60 * GB
    # the store alone is the build's to check (poros/store/host_memory.py): a plan with nothing in host memory passes
    assert not make_plan(q72, TrainConfig(**{**kw, "offload_inputs": False}, host_budget="10GB")).host_inputs


def test_a_budget_keeps_as_many_inputs_on_the_device_as_fit_and_the_host_the_rest(q72):
    """At 32,768 tokens within 40 GB: the split that copies the fewest bytes; one more input on the device
    would not fit, and a tighter host budget moves inputs onto the device (the weights give way)."""
    kw = dict(seq_len=32768, loss_chunk=4096, attention="fast", deterministic=True, overlap_backward=False,
              budget=40 * GB)
    loose = plan_for_budget(q72, plan_request(**kw, host_budget=200 * GB))
    assert loose.memory.total <= 40 * GB and loose.host_inputs and loose.host_bytes <= 200 * GB
    more = build_plan(q72, plan_request(**kw, host_budget=200 * GB, device_inputs=len(loose.device_input_layers) + 1,
                                        resident_layers=len(loose.resident_layers), head_resident=loose.head_resident,
                                        block_size=loose.block_size))
    assert more.memory.total > 40 * GB
    tight = plan_for_budget(q72, plan_request(**kw, host_budget=80 * GB))  # 66 layers' inputs beside the store
    assert tight.memory.total <= 40 * GB and tight.host_bytes <= 80 * GB < loose.host_bytes
    assert len(tight.device_input_layers) > len(loose.device_input_layers)
    assert len(tight.resident_layers) < len(loose.resident_layers)
    with pytest.raises(BudgetError, match=r"vram_budget 40 GB is below .*; host_budget [0-9.]+ GB holds the saved "
                                          r"inputs of 9 of 80 layers beside the NF4 store \(44.48 GB\), the device the rest$"):
        plan_for_budget(q72, plan_request(**kw, host_budget=loose.store_bytes + 5 * GB))


def test_poros_plan_prints_the_split_and_refuses_a_host_that_cannot_hold_it(capsys):
    import json

    from poros.cli import main
    from tests.fixtures import one_line_refusal

    argv = ["plan", "--model", "qwen2.5-72b", "--seq-len", "16384", "--offload-inputs"]
    assert main([*argv, "--device-inputs", "30", "--host-budget", "100GB"]) == 0
    out = capsys.readouterr().out
    assert "saved layer inputs: device for layers 50-79 (30), host memory for 0-49 (50)" in out, out
    assert "host memory: NF4 store 44.48 GB + saved inputs 13.42 GB (50 slots, page-locked) = 57.90 GB " \
           "(host budget 100 GB)" in out, out
    assert main([*argv, "--device-inputs", "30", "--host-budget", "100GB", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["host_inputs"] == list(range(50)) and summary["device_inputs"] == 30
    store = store_bytes(resolve("qwen2.5-72b").config)  # what a build's host check counts for the store
    assert summary["host_bytes"] == store + 50 * 16384 * 8192 * 2 and summary["host_budget"] == 100 * GB
    one_line_refusal(capsys, main([*argv, "--host-budget", "60GB"]), "80 layers in host memory",
                     "more than host_budget 60 GB")
