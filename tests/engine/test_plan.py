"""The planner: plans from shapes alone, their bytes and memory, and the rules every plan must keep,
each with a plan that breaks it (refused by `check`, and by the executor)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poros.engine.planning import memory
from poros.engine.planning import plan as P
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.memory import GRAPH_POOL_PER_LAYER, fused_backward_bytes, transient_bytes
from poros.engine.planning.rules import check
from poros.engine.planning.search import (
    build_plan,
    kept_set,
    resident_set,
)
from poros.engine.planning.budget import make_plan, plan_for_budget
from poros.models.checkpoint import resolve
from poros.errors import BudgetError
from poros.choices import Accumulation, Attention, Placement
from poros.settings import LORA_TARGETS
from tests.faults import refill_before_backward, reverse_micro_batches_in_backward
from tests.plans import plan_request


def geometry(model: str) -> Geometry:
    return Geometry.of_config(model, resolve(model).config, LORA_TARGETS)


@pytest.fixture(scope="module")
def tiny():
    return geometry("tiny-qwen2")


def test_72b_streams_75_6_gb_a_step(q72):
    """Every layer copied twice per micro-batch but for the two blocks left over at each turn, the
    lm_head once and the block whose buffer it borrowed once more: 75.56 GB (measured on the H200)."""
    plan = build_plan(q72, plan_request(block_size=4))
    assert abs(plan.h2d_bytes_per_step - 75.56e9) / 75.56e9 < 0.01
    assert plan.loads_per_step == 20 - 2 + 20 - 1  # forward loads blocks 2..19, backward 18..0
    assert plan.resident_layers == [] and len(plan.streamed_layers) == 80


def test_geometry_from_shapes_matches_a_built_store(stores):
    store = stores("tiny-gemma4")
    geo = geometry("tiny-gemma4")
    assert geo.layer_starts == tuple(x.start for x in store.layers)
    assert geo.layer_ends == tuple(x.end for x in store.layers)


@pytest.mark.parametrize("accum", [2, 8, 32])
def test_layer_major_copies_as_much_per_step_as_one_micro_batch(q72, accum):
    one = build_plan(q72, plan_request(block_size=4, grad_accum=1))
    layer = build_plan(q72, plan_request(block_size=4, grad_accum=accum, accumulation=Accumulation.LAYER))
    micro = build_plan(q72, plan_request(block_size=4, grad_accum=accum, accumulation=Accumulation.MICRO))
    assert layer.h2d_bytes_per_step == one.h2d_bytes_per_step
    assert micro.h2d_bytes_per_step == accum * one.h2d_bytes_per_step


def test_resident_layers_and_head_cut_the_copies(q72):
    streamed = build_plan(q72, plan_request(block_size=4))
    half = build_plan(q72, plan_request(block_size=4, resident_layers=40, head_resident=True))
    assert half.resident_layers == list(range(40, 80)) and half.streamed_layers == list(range(40))
    assert half.h2d_bytes_per_step < streamed.h2d_bytes_per_step / 2
    assert half.memory.resident_weights == half.buffers[-1].nbytes + q72.head_bytes
    everything = build_plan(q72, plan_request(block_size=4, resident_layers=80))
    assert everything.h2d_bytes_per_step == 0 and everything.head_resident
    assert everything.setup and all(op.kind == P.LOAD for op in everything.setup)


def test_saved_inputs_in_host_memory_trade_device_memory_for_copies(q72):
    on_device = build_plan(q72, plan_request(block_size=4, grad_accum=8))
    on_host = build_plan(q72, plan_request(block_size=4, grad_accum=8, offload_inputs=True))
    per_input = 512 * 8192 * 2
    assert on_host.d2h_bytes_per_step == 80 * 8 * per_input
    assert on_host.h2d_bytes_per_step == on_device.h2d_bytes_per_step + 80 * 8 * per_input
    assert on_device.memory.saved_inputs == 80 * 8 * per_input
    assert on_host.memory.saved_inputs == (4 * 8 + 8) * per_input
    assert on_host.memory.total < 12e9 < on_device.memory.total


@pytest.mark.parametrize("budget", [12e9, 16e9, 24e9, 40e9, 64e9])
def test_a_budget_picks_the_fewest_bytes_that_fit(q72, budget):
    plan = plan_for_budget(q72, plan_request(block_size=4, attention="math", budget=int(budget)))
    assert plan.memory.total <= budget
    # one more resident layer would not fit at any block size the planner tried
    more = build_plan(q72, plan_request(block_size=plan.block_size, resident_layers=len(plan.resident_layers) + 1,
                        head_resident=True, attention="math")) if plan.streamed_layers else None
    assert more is None or more.memory.total > budget or more.h2d_bytes_per_step >= plan.h2d_bytes_per_step
    smaller = plan_for_budget(q72, plan_request(block_size=4, attention="math", budget=int(budget * 0.8))) if budget > 12e9 else None
    assert smaller is None or smaller.h2d_bytes_per_step >= plan.h2d_bytes_per_step


def test_a_budget_below_the_smallest_plan_names_the_smallest_that_works(q72):
    with pytest.raises(BudgetError, match=r"below the smallest plan for qwen2.5-72b .* use --vram-budget [0-9.]+GB"):
        plan_for_budget(q72, plan_request(block_size=4, budget=2 * 10**9))


@settings(max_examples=40, deadline=None)
@given(resident=st.integers(0, 5), block=st.integers(1, 6), accum=st.integers(1, 4),
       order=st.sampled_from(list(Accumulation)), head=st.sampled_from([None, True]), keep=st.booleans(),
       kept=st.sampled_from([None, 1, 2, 9]), placement=st.sampled_from(list(Placement)))
def test_every_plan_keeps_the_rules(resident, block, accum, order, head, keep, kept, placement):
    plan = build_plan(geometry("tiny-gemma3"), plan_request(block_size=block, grad_accum=accum, accumulation=order,
                        resident_layers=resident, head_resident=head, keep_activations=keep, kept_layers=kept if keep else None,
                        placement=placement))
    assert check(plan) == []
    assert plan.resident_layers == list(resident_set(5, resident, placement))
    assert plan.kept_layers == (kept_set(tuple(plan.resident_layers), kept) if keep else ())
    assert set(plan.kept_layers) <= set(plan.resident_layers)
    assert len(plan.kept_layers) == (min(resident, kept or resident) if keep else 0)
    assert plan.resident_layers + plan.streamed_layers == list(range(5)) or \
        sorted(plan.resident_layers + plan.streamed_layers) == list(range(5))


# --- each rule, broken ---------------------------------------------------------------------------

def _without(plan, pos):
    return replace(plan, step=plan.step[:pos] + plan.step[pos + 1:])


def test_rule_weights_present(tiny):
    plan = build_plan(tiny, plan_request(block_size=1))
    pos = next(i for i, op in enumerate(plan.step) if op.kind == P.LOAD and i > len(plan.step) // 2)
    problems = check(_without(plan, pos))  # a backward-phase reload dropped
    assert any("weights are not present" in p for p in problems), problems


def test_rule_no_load_before_the_release_of_the_buffers_last_reader(tiny):
    """A load enqueued before the release that follows the last read of the buffer's contents: the copy
    would not wait for those reads."""
    plan = build_plan(tiny, plan_request(block_size=1))
    ops = list(plan.step)
    pos = next(i for i, (a, b) in enumerate(zip(ops, ops[1:]))
               if a.kind == P.RELEASE and b.kind == P.LOAD and a.buffer == b.buffer)
    ops[pos], ops[pos + 1] = ops[pos + 1], ops[pos]
    problems = check(replace(plan, step=tuple(ops)))
    assert any("before the release after the last read" in p for p in problems), problems


def test_rule_no_refill_before_the_backward_that_reads_it(tiny):
    """The bitsandbytes trap: another group loaded into a buffer whose group's backward is still to come."""
    problems = check(refill_before_backward(build_plan(tiny, plan_request(block_size=1))))
    assert any("weights are not present" in p for p in problems), problems


def test_rule_backward_after_forward_and_head(tiny):
    plan = build_plan(tiny, plan_request(block_size=5))
    ops = list(plan.step)
    head = next(i for i, op in enumerate(ops) if op.kind == P.HEAD)
    bwd = next(i for i, op in enumerate(ops) if op.kind == P.BACKWARD)
    ops[head], ops[bwd] = ops[bwd], ops[head]
    problems = check(replace(plan, step=tuple(ops)))
    assert any("backward before the head" in p for p in problems), problems


def test_rule_micro_batches_accumulate_in_order(tiny):
    plan = build_plan(tiny, plan_request(block_size=2, grad_accum=3))
    problems = check(reverse_micro_batches_in_backward(plan))
    assert any("LoRA gradients would be summed in another order" in p for p in problems), problems


def test_rule_every_layer_once(tiny):
    plan = build_plan(tiny, plan_request(block_size=2))
    pos = next(i for i, op in enumerate(plan.step) if op.kind == P.BACKWARD)
    problems = check(_without(plan, pos))
    assert any("one forward and one backward" in p for p in problems), problems


def test_rule_steady_state_loads_in_setup(tiny):
    plan = build_plan(tiny, plan_request(block_size=1))
    problems = check(replace(plan, setup=()))  # nothing loaded before the first step
    assert any("weights are not present" in p for p in problems), problems


# --- resident placement --------------------------------------------------------------------------

@pytest.mark.parametrize("n,resident,placement,want", [
    (10, 4, Placement.TAIL, (6, 7, 8, 9)),
    (10, 6, Placement.SPREAD, (1, 3, 4, 6, 8, 9)),  # streamed 0, 2, 5, 7
    (10, 0, Placement.SPREAD, ()),
    (10, 10, Placement.SPREAD, tuple(range(10))),
    (80, 60, Placement.SPREAD, tuple(i for i in range(80) if i % 4)),
])
def test_resident_set(n, resident, placement, want):
    assert resident_set(n, resident, placement) == want


@pytest.mark.parametrize("resident,count,want", [
    ((1, 2, 3, 4), None, (1, 2, 3, 4)), ((1, 2, 3, 4), 9, (1, 2, 3, 4)), ((1, 2, 3, 4), 2, (1, 3)),
    ((0, 3, 5, 6, 9, 11), 3, (0, 5, 9)), ((4,), 1, (4,)), ((), 3, ())])
def test_kept_set_spreads_the_kept_layers_among_the_resident_ones(resident, count, want):
    assert kept_set(resident, count) == want


def test_kept_layers_trade_kept_activations_for_resident_layers_under_a_budget(q72):
    """Fewer kept layers leave room for more resident ones in the same budget."""
    kw = dict(block_size=4, seq_len=512, cuda_graphs=True, keep_activations=True, placement=Placement.SPREAD)
    every, some = (plan_for_budget(q72, plan_request(kept_layers=k, **kw, budget=40 * 10**9)) for k in (None, 20))
    assert len(some.kept_layers) == 20 < len(every.kept_layers) == len(every.resident_layers)
    assert len(some.resident_layers) > len(every.resident_layers)
    assert some.memory.kept_activations < every.memory.kept_activations
    assert max(p.memory.total for p in (every, some)) <= 40 * 10**9


def test_a_spread_plan_copies_what_a_tail_plan_does_and_prefetches_across_resident_layers(q72):
    """The same resident count either way: the same bytes cross per step (each streamed layer once per
    pass, less what stays across the turn); in a spread plan's forward a streamed group's load is enqueued
    when the streamed group before it starts, so resident layers run between the load and the forward
    that waits for it."""
    tail = build_plan(q72, plan_request(block_size=1, resident_layers=60, head_resident=True))
    spread = build_plan(q72, plan_request(block_size=1, resident_layers=60, head_resident=True, placement=Placement.SPREAD))
    assert spread.streamed_layers == list(range(0, 80, 4)) and len(spread.buffers) == 2 + 20
    assert spread.h2d_bytes_per_step == tail.h2d_bytes_per_step
    step = spread.step
    load8 = next(k for k, op in enumerate(step) if op.kind == P.LOAD and spread.groups[op.group].first == 8)
    fwd4 = next(k for k, op in enumerate(step) if op.kind == P.FORWARD and op.layer == 4)
    fwd8 = next(k for k, op in enumerate(step) if op.kind == P.FORWARD and op.layer == 8)
    assert load8 < fwd4 < fwd8
    assert [op.layer for op in step[fwd4:fwd8] if op.kind == P.FORWARD] == [4, 5, 6, 7]


def test_a_spread_budget_plan_fits_and_keeps_more_layers(q72):
    """Spread streamed runs are one layer long, so the rotating buffers shrink to one layer each and the
    budget keeps at least as many layers resident as the tail placement's best block size leaves room for. (Bytes per
    step need not be fewer: a tail plan's first and last groups, whole blocks, stay across the step's
    boundary and the turn, a spread plan's single layers.)"""
    tail = plan_for_budget(q72, plan_request(block_size=4, cuda_graphs=True, budget=40 * 10**9))
    spread = plan_for_budget(q72, plan_request(block_size=4, cuda_graphs=True, placement=Placement.SPREAD, budget=40 * 10**9))
    assert spread.memory.total <= 40 * 10**9 and check(spread) == []
    assert len(spread.resident_layers) >= len(tail.resident_layers)
    assert max(len(g.layers) for g in spread.groups if not g.resident) == 1


RESERVED_ROWS = Path(__file__).resolve().parents[2] / "experiments/h200-reserved-memory/reserved_qwen2.5-72b_seq16384.jsonl"


def test_fused_attention_backward_counted_where_an_eager_long_context_plan_was_measured(q72, monkeypatch):
    """An eager 24 GB plan (no CUDA graphs, no overlapped backward) at 16,384 tokens on the fast path under
    strict determinism peaked at 26.0 GB allocated on the H200, where the planner without fused attention's
    backward workspace had predicted 23.84 GB. Rebuilt as it ran, the plan now predicts that peak within
    0.5%; without the workspace (the negative control) the prediction falls 8% short."""
    from poros.config import TrainConfig

    rows = [json.loads(line) for line in RESERVED_ROWS.read_text().splitlines()]
    eager = [r for r in rows if not r["variant"].get("cuda_graphs")]
    assert eager
    for row in eager:
        cfg = TrainConfig(model=row["model"], seq_len=row["seq_len"], attention="fast", deterministic=True,
                          loss_chunk=4096).replace(**{k: v for k, v in row["variant"].items()})
        with monkeypatch.context() as m:  # the plan the row ran: the planner of its commit had no such term
            m.setattr(memory, "fused_backward_bytes", lambda *a, **k: 0)
            ran = make_plan(q72, cfg)
        # and it brought saved inputs back two blocks ahead where plans now bring them one block ahead
        earlier_window = ran.block_size * ran.grad_accum * ran.input_bytes if ran.offload_inputs else 0
        assert round((ran.memory.total + earlier_window) / 1e9, 3) == row["predicted_peak_gb"]
        now = build_plan(q72, plan_request(block_size=ran.block_size, resident_layers=len(ran.resident_layers),
                           head_resident=ran.head_resident, seq_len=cfg.seq_len, attention="fast", overlap_backward=False,
                           offload_inputs=ran.offload_inputs, loss_chunk=4096, deterministic=True))
        measured = row["peak_allocated_gb"] * 1e9
        assert abs(now.memory.total + earlier_window - measured) <= 0.005 * measured
        assert ran.memory.total < 0.95 * measured  # negative control: the check fails without the term
        assert make_plan(q72, cfg).memory.total <= 24 * 10**9  # and a 24 GB budget now plans for it


def test_fused_attention_backward_workspace(q72):
    """None on the math path; one float32 dQ accumulator per split under strict determinism (3 splits
    for 64 heads on 132 multiprocessors), one without."""
    assert fused_backward_bytes(q72, 16384, 1, Attention.MATH, True) == 0
    strict, loose = (fused_backward_bytes(q72, 16384, 1, Attention.FAST, d) for d in (True, False))
    assert strict - loose == 2 * 16384 * q72.q_width * 4
    assert q72.q_width == 8192 and q72.heads == 64


def test_fa4_backward_workspace(q72):
    """FlashAttention-4's backward, strict or not: one float32 dQ accumulator, float32 dK and dV accumulators for
    grouped key/value heads, two float32 rows per token and head; a model some of whose calls FA4 leaves to `fast`
    (gemma3's sliding-window layers, masked) counts fast's workspace where it is the larger."""
    tokens = 16384
    fa4 = [fused_backward_bytes(q72, tokens, 1, Attention.FA4, d) for d in (True, False)]
    assert fa4[0] == fa4[1] == tokens * (q72.q_width * 4 + 2 * q72.kv_width * 4 + 2 * 4 * q72.heads)
    assert q72.kv_width == 1024 and not q72.other_attention
    assert fa4[0] < fused_backward_bytes(q72, tokens, 1, Attention.FAST, False)
    gemma = Geometry.of_config("gemma3-27b", resolve("gemma3-27b").config, LORA_TARGETS)
    assert gemma.other_attention
    assert fused_backward_bytes(gemma, tokens, 1, Attention.FA4, True) == \
        fused_backward_bytes(gemma, tokens, 1, Attention.FAST, True)
    # the control: the same model with every call on FA4 would count FA4's alone
    assert fused_backward_bytes(replace(gemma, other_attention=False), tokens, 1, Attention.FA4, True) < \
        fused_backward_bytes(gemma, tokens, 1, Attention.FAST, True)


def test_a_graph_plan_names_its_pool(q72):
    """Under CUDA graphs the templates' intermediates sit in the graphs' pool, reserved beside the allocated
    peak: the plan counts it in the process's total and says how much; an eager plan has none."""
    graphs = build_plan(q72, plan_request(block_size=1, seq_len=16384, attention="fast", cuda_graphs=True, overlap_backward=False,
                          deterministic=True))
    eager = build_plan(q72, plan_request(block_size=1, seq_len=16384, attention="fast", overlap_backward=False, deterministic=True))
    _, layer = transient_bytes(q72, 16384, 1, Attention.FAST, overlap=False, deterministic=True)
    assert graphs.graph_pool == -(-layer * GRAPH_POOL_PER_LAYER // 100) > layer > 10**10 and eager.graph_pool == 0
    assert graphs.memory.total == graphs.memory.allocated + graphs.graph_pool  # no process costs asked for
    assert "graph_pool" in P.describe(graphs) and "graph_pool" not in P.describe(eager)


@pytest.mark.parametrize("model, loads", [("qwen3-32b", (29, 27, 25)), ("qwen2.5-72b", (37, 35, 33))])
def test_each_stream_buffer_beyond_two_keeps_a_block_at_the_turn_and_at_the_step_end(model, loads):
    """Every layer streamed through 2, 3 and 4 rotating buffers: each buffer more keeps one more block where the
    forward turns into the backward and where a step ends in the next one's first blocks, so two loads a step fewer;
    the buffers hold a block each, the lm_head borrows the buffer of the group before the last and every rule holds.
    Prefetches run `stream_buffers - 1` groups ahead."""
    geo = geometry(model)
    plans = [build_plan(geo, plan_request(stream_buffers=k)) for k in (2, 3, 4)]
    assert tuple(p.loads_per_step for p in plans) == loads
    for k, p in zip((2, 3, 4), plans):
        assert check(p) == []
        stream = [b for b in p.buffers if not b.resident]
        assert len(stream) == k and len({b.nbytes for b in stream}) == 1
        streamed = [g for g in p.groups if not g.resident]
        assert p.head_buffer == streamed[-2].buffer and {g.buffer for g in streamed} == set(range(k))
        assert p.memory.weight_buffers == k * stream[0].nbytes + p.head_pad
        first = [op for op in p.step if op.kind == P.LOAD][0]  # the forward's first load: the group k groups in
        assert first.group == streamed[k].index
    # the step's first loads are enqueued before the compute reaches the group before them: k - 1 groups ahead
    p = plans[1]
    ops = [str(op) for op in p.step]
    assert ops.index("load:g4:b1") < ops.index("forward:g2:L8:m0"), ops[:20]


@pytest.mark.parametrize("buffers", [1, 9, "3", True, 2.5])
def test_a_stream_buffer_count_out_of_range_is_refused_in_one_line(buffers):
    from poros.config import TrainConfig
    from poros.errors import ConfigError

    with pytest.raises(ConfigError, match=r"stream_buffers.*expected an integer from 2 to 8"):
        TrainConfig(model="tiny-qwen2", stream_buffers=buffers)
    assert TrainConfig(model="tiny-qwen2", stream_buffers=8).stream_buffers == 8  # control: the range's top holds
