"""A plan's step on an ideal host (poros/engine/planning/timeline.py): never below either floor, at the compute floor
with nothing to copy, and, for a streamed qwen3-32b step, where the profile of its run found the link idle."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from poros.config import TrainConfig
from poros.engine.planning import plan as P
from poros.engine.planning.budget import make_plan
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.timeline import CostModel, simulate
from poros.harness.report.schedule import plan_as_ran

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "results/h100-fastest/qwen3-32b-run2/results.jsonl"
PROFILE = ROOT / "experiments/h100-streamed-link-idle/copy-groups/prof.jsonl"


def costs_at(row: dict, plan: P.Plan, geo: Geometry) -> CostModel:
    """`plan`'s costs at the link and compute floor a run's `row` recorded (seq 512, one sequence a micro-batch)."""
    return CostModel.of(plan, geo, 512, 512, row["compute_floor_s"], row["link_h2d_gbps"] * 1e9)


def ran(plan_name: str, run: Path = RUN) -> tuple[dict, P.Plan, Geometry, CostModel]:
    """A row of a committed run (the qwen3-32b one unless `run` names another), its plan built again as it ran
    (poros/harness/report/schedule.py), and its costs at that run's floors."""
    row = next(r for r in map(json.loads, run.read_text().splitlines()) if r.get("plan_name") == plan_name)
    plan, geo, cfg = plan_as_ran(row)
    assert cfg.seq_len == 512 and cfg.batch_size == 1
    assert plan.resident_layers == row["plan"]["resident_layers"] and plan.block_size == row["plan"]["block_size"]
    return row, plan, geo, costs_at(row, plan, geo)


@pytest.mark.parametrize("plan_name", ["streamed", "streamed+3buffers", "half", "half+spread"])
def test_a_schedule_lies_between_its_floors_and_the_measured_step(plan_name):
    row, plan, _, costs = ran(plan_name)
    t = simulate(plan, costs)
    assert t.compute_s == pytest.approx(row["compute_floor_s"])  # the costs share the compute floor out, no more
    assert t.copy_s == pytest.approx(plan.h2d_bytes_per_step * costs.link_s_per_byte)
    assert max(t.copy_s, t.compute_s) <= t.step_s <= row["s_per_step_median"]
    assert t.link_idle_s == pytest.approx(t.step_s - t.copy_s)


def test_with_nothing_to_copy_the_schedule_is_the_compute_floor():
    row, _, geo, _ = ran("streamed")
    cfg = TrainConfig.from_settings(row["config"], model=row["config"]["model"], vram_budget="1000GB")
    plan = make_plan(geo, cfg)
    assert not plan.streamed_layers and plan.h2d_bytes_per_step == 0
    t = simulate(plan, CostModel.of(plan, geo, 512, 512, 0.25, 55e9))
    assert t.step_s == pytest.approx(0.25) and t.copy_s == 0 and t.compute_wait_s == pytest.approx(0)


def test_the_link_idles_where_the_profile_found_compute_with_nothing_copied():
    """The streamed step's profile (same machine, right after the run) found the link idle with compute running for
    22.6 ms a step: the blocks reused across the step's ends and at the turn. The schedule idles it 21.3 ms, within
    10%. Negative control: the same plan with its releases dropped (every load free to start at once, as if the
    buffers were endless) idles the link 3 ms, the head's compute alone: the idle comes from the buffers' order."""
    profile = json.loads(PROFILE.read_text().splitlines()[-1])
    _, plan, _, costs = ran("streamed")
    idle = simulate(plan, costs).link_idle_s
    assert idle == pytest.approx(profile["link_idle_compute_s"], rel=0.1)
    endless = dataclasses.replace(plan, step=tuple(op for op in plan.step if op.kind != P.RELEASE))
    assert simulate(endless, costs).link_idle_s < 0.2 * profile["link_idle_compute_s"]


def test_bad_costs_and_shared_copies_are_refused():
    _, plan, geo, costs = ran("streamed")
    with pytest.raises(ValueError, match="positive"):
        CostModel.of(plan, geo, 512, 512, 0.0, 55e9)
    with pytest.raises(ValueError, match="shared among ranks"):
        simulate(dataclasses.replace(plan, shards=2), costs)


def test_two_layer_blocks_through_three_buffers_idle_the_link_less_on_gemma3():
    """`streamed+block2x3` (matrices/h100-fastest.yaml): gemma3-27b's every layer streamed in blocks of two through
    three buffers, at the link and compute floor of the committed `streamed` row (results/h100-fastest/gemma3-27b-run2),
    copies the same bytes in about the same memory, and its schedule idles the link less at the step's turns: a
    shorter step, nearer its copy floor. Negative control: blocks of two through two buffers idle it less too, but
    reuse fewer layers across the turns, so they copy more and their step is longer than the default's."""
    row, default, geo, _ = ran("streamed", ROOT / "results/h100-fastest/gemma3-27b-run2/results.jsonl")
    cfg = TrainConfig.from_settings(row["config"], model=row["config"]["model"])

    def step(plan):
        return simulate(plan, costs_at(row, plan, geo))

    pairs = make_plan(geo, cfg.replace(block_size=2, stream_buffers=3))
    assert (default.block_size, len(default.buffers)) == (4, 2) and len(pairs.buffers) == 3
    assert pairs.h2d_bytes_per_step == default.h2d_bytes_per_step
    assert abs(pairs.memory.total - default.memory.total) < 0.01 * default.memory.total
    ours, before = step(pairs), step(default)
    assert ours.step_s < before.step_s and ours.link_idle_s < 0.7 * before.link_idle_s
    assert ours.copy_s / ours.step_s > 0.97 > before.copy_s / before.step_s
    two = make_plan(geo, cfg.replace(block_size=2, stream_buffers=2))
    assert two.h2d_bytes_per_step > default.h2d_bytes_per_step and step(two).step_s > before.step_s


def test_the_measured_steps_keep_the_order_the_schedules_gave_on_gemma3():
    """The two plans measured in one process (results/h100-fastest/gemma3-27b-run3), each at its run's floors as a page
    takes them (poros/harness/report/floor.py): each step lies above its schedule floor, and blocks of two through
    three buffers have both the shorter schedule and the shorter measured step. Negative control: the run's measured
    steps swapped between the two plans break the order."""
    from poros.harness.report import load_results
    from poros.harness.report.floor import with_floors

    df = with_floors(load_results(ROOT / "results/h100-fastest/gemma3-27b-run3/results.jsonl"))
    rows = {r["plan_name"]: r for r in df.to_dict("records")}
    default, pairs = rows["streamed"], rows["streamed+block2x3"]
    for r in (default, pairs):
        assert max(r["copy_floor_s"], r["compute_floor_s"]) < r["schedule_floor_s"] < r["s_per_step_median"]

    def ordered(d: float, p: float) -> bool:
        return pairs["schedule_floor_s"] < default["schedule_floor_s"] and p < d

    assert ordered(default["s_per_step_median"], pairs["s_per_step_median"])
    assert not ordered(pairs["s_per_step_median"], default["s_per_step_median"])
