"""The smallest budget and the longest sequence a plan fits (poros/engine/planning/limits.py, `poros plan
--smallest-budget` / `--longest-seq-len`) on the geometries of real models (shapes alone, no weights): the edge
found is one at which the planner makes a plan and one step past it none, and a fit that is not monotone is
named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poros.cli import main
from poros.config import TrainConfig
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.limits import (
    BUDGET_STEP,
    SEQ_LEN_STEP,
    at_seq_len,
    highest_fit,
    longest_seq_len,
    lowest_fit,
    out_of_order,
    smallest_budget,
)
from poros.engine.planning.budget import make_plan, plan_for_budget
from poros.engine.planning.search import PlanRequest
from poros.errors import BudgetError, ConfigError
from poros.harness.matrix import load_matrix
from poros.models.checkpoint import resolve
from poros.settings import LORA_TARGETS

ROOT = Path(__file__).resolve().parents[2]
LONG = dict(attention="fast", deterministic=True, loss_chunk=4096, offload_inputs=True)  # h200-long's settings
MODELS = ("qwen2.5-72b", "qwen3-32b", "gemma3-27b", "gemma4-31b")


@pytest.fixture(scope="module")
def geometries() -> dict:
    return {m: Geometry.of_config(m, resolve(m).config, LORA_TARGETS) for m in MODELS}


def cfg(model: str, **kw) -> TrainConfig:
    return TrainConfig(model=model, device="cuda", **{**LONG, **kw})


def fits(geo: Geometry, config: TrainConfig) -> bool:
    """Whether the planner makes a plan for `config` (its budget, its length) at all."""
    try:
        plan = make_plan(geo, config)
    except BudgetError:
        return False
    assert plan.memory.total <= config.vram_budget
    return True


# --- the smallest budget --------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"model={m}")
def test_the_smallest_budget_holds_a_plan_and_one_step_below_none_does(geometries, model):
    geo, settings_ = geometries[model], cfg(model, seq_len=16384)
    limit = smallest_budget(geo, PlanRequest.of_config(settings_))
    assert limit.value % BUDGET_STEP == 0 and limit.monotone
    assert limit.plan.memory.total <= limit.value == limit.plan.budget
    assert fits(geo, settings_.replace(vram_budget=limit.value))
    assert not fits(geo, settings_.replace(vram_budget=limit.value - BUDGET_STEP))  # the negative side
    # the planner's own refusal one step below names the same budget
    with pytest.raises(BudgetError, match=f"use --vram-budget {limit.value / 1e9:g}GB or more"):
        plan_for_budget(geo, PlanRequest.of_config(settings_.replace(vram_budget=limit.value - BUDGET_STEP)))
    # every budget asked below it holds no plan, every one from it on does
    assert all(ok == (v >= limit.value) for v, ok in limit.tried)


def test_a_longer_sequence_needs_a_larger_smallest_budget(geometries):
    geo = geometries["qwen3-32b"]
    values = [smallest_budget(geo, PlanRequest.of_config(cfg("qwen3-32b", seq_len=n))).value for n in (4096, 16384)]
    assert values[0] < values[1]


# --- the longest sequence -------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"model={m}")
def test_the_longest_sequence_fits_and_one_step_longer_does_not(geometries, model):
    geo, budget = geometries[model], cfg(model, vram_budget="24GB")
    limit = longest_seq_len(geo, PlanRequest.of_config(budget), resolve(model).config.max_position_embeddings)
    assert limit.value % SEQ_LEN_STEP == 0 and limit.monotone and not limit.at_top
    assert fits(geo, budget.replace(seq_len=limit.value))
    assert not fits(geo, budget.replace(seq_len=limit.value + SEQ_LEN_STEP))  # the negative side
    assert all(ok == (v <= limit.value) for v, ok in limit.tried)


def test_the_longest_sequence_reaches_a_matrix_run_within_its_budget(geometries):
    """matrices/h200-compile-long.yaml runs qwen2.5-72b at 16,384 tokens within 24 GB: its settings reach at least
    that far, to a step of 512 tokens."""
    m = load_matrix(ROOT / "matrices" / "h200-compile-long.yaml")
    run = TrainConfig.from_settings(m.settings_for("qwen2.5-72b", {"compile": True}, None, "24GB+offload"),
                                    model="qwen2.5-72b", device="cuda")
    assert run.seq_len == 16384 and run.vram_budget == 24 * 10**9
    limit = longest_seq_len(geometries["qwen2.5-72b"], PlanRequest.of_config(run), 131072, step=512)
    assert limit.value >= run.seq_len and limit.value % 512 == 0
    assert not fits(geometries["qwen2.5-72b"], run.replace(seq_len=limit.value + 512))


def test_a_budget_that_holds_the_model_at_its_longest_reports_the_top():
    geo = Geometry.of_config("tiny-qwen2", resolve("tiny-qwen2").config, LORA_TARGETS)
    top = resolve("tiny-qwen2").config.max_position_embeddings
    limit = longest_seq_len(geo, PlanRequest.of_config(cfg("tiny-qwen2", vram_budget="2GB")), top, step=256)
    assert limit.at_top and limit.value == top and limit.monotone


def test_a_budget_below_the_smallest_plan_at_any_length_is_refused_naming_one_that_holds(geometries):
    geo, budget = geometries["qwen2.5-72b"], cfg("qwen2.5-72b", vram_budget="2GB")
    with pytest.raises(BudgetError, match=r"no sequence length fits: .* at 1024 tokens .*use --vram-budget "
                                          r"([0-9.]+)GB or more, or a smaller --seq-len-step") as e:
        longest_seq_len(geo, PlanRequest.of_config(budget), 131072)
    named = float(e.value.args[0].split("use --vram-budget ")[1].split("GB")[0])
    assert fits(geo, budget.replace(seq_len=SEQ_LEN_STEP, vram_budget=f"{named}GB"))


def test_the_longest_sequence_needs_a_budget_and_a_step_within_the_model(geometries):
    geo = geometries["qwen3-32b"]
    with pytest.raises(ConfigError, match="give one, e.g. --vram-budget 24GB"):
        longest_seq_len(geo, PlanRequest.of_config(cfg("qwen3-32b")), 40960)
    with pytest.raises(ConfigError, match="seq_len_step: 65536 is longer than the longest sequence qwen3-32b takes"):
        longest_seq_len(geo, PlanRequest.of_config(cfg("qwen3-32b", vram_budget="24GB")), 40960, step=65536)


def test_at_seq_len_changes_the_length_alone():
    request = PlanRequest.of_config(cfg("qwen3-32b", vram_budget="24GB"))
    longer = at_seq_len(request, 8192)
    assert longer.config == request.config.replace(seq_len=8192) and longer.budget == request.budget


# --- the search, on fits made up for the test -----------------------------------------------------

PLAN = object()  # a stand-in plan: the search reads only whether one came back


@settings(max_examples=60, deadline=None)
@given(edge=st.integers(1, 5000), step=st.sampled_from([1, 7, 100]))
def test_bisection_finds_the_edge_of_a_monotone_fit(edge, step):
    low = lowest_fit(lambda v: PLAN if v >= edge else None, step, lambda p: False, cap=10**6)
    assert low.value == -(-edge // step) * step and low.monotone
    high = highest_fit(lambda v: PLAN if v <= edge else None, step, top=10**5)
    assert (high is None) == (edge < step)
    assert high is None or (high.value == edge // step * step and high.monotone)


def test_a_fit_that_is_not_monotone_is_named():
    """Negative control: a fit with a gap (a plan at 10 to 19 tokens, none at 20 to 39, one again from 40) reads
    as not monotone, and the same fit without the gap as monotone."""
    gap = highest_fit(lambda v: PLAN if v < 20 or 40 <= v <= 64 else None, 1, top=100)
    assert not gap.monotone and (64, 20) in gap.out_of_order and gap.value == 19
    assert highest_fit(lambda v: PLAN if v < 20 else None, 1, top=100).monotone
    # budgets: a plan at 8, none at 16 to 31, one again from 32
    hole = lowest_fit(lambda v: PLAN if v == 8 or v >= 32 else None, 1, lambda p: False, cap=128)
    assert not hole.monotone and (8, 16) in hole.out_of_order
    assert lowest_fit(lambda v: PLAN if v >= 8 else None, 1, lambda p: False, cap=128).monotone


def test_out_of_order_pairs():
    assert out_of_order([(1, False), (2, True), (3, False)], rising=True) == ((2, 3),)
    assert out_of_order([(1, True), (2, False), (3, True)], rising=False) == ((3, 2),)
    assert out_of_order([(1, False), (2, True), (3, True)], rising=True) == ()
    assert out_of_order([(1, True), (2, False), (3, False)], rising=False) == ()


def test_nothing_fits_gives_none():
    assert lowest_fit(lambda v: None, 1, lambda p: True, cap=64) is None
    assert highest_fit(lambda v: None, 1, top=64) is None


# --- poros plan -----------------------------------------------------------------------------------

LONG_FLAGS = ["--attention", "fast", "--deterministic", "--loss-chunk", "4096", "--offload-inputs"]


def test_poros_plan_prints_the_smallest_budget_and_its_plan(capsys):
    argv = ["plan", "--model", "qwen3-32b", "--seq-len", "8192", *LONG_FLAGS]
    assert main([*argv, "--smallest-budget"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("smallest VRAM budget for qwen3-32b at seq_len 8192: --vram-budget ")
    flag = first.split("--vram-budget ")[1].split(" ")[0]
    below = f"{round(float(flag.removesuffix('GB')) - 0.1, 1):g}GB"
    assert f"(no plan fits {below})" in first and "fit monotone at all" in out and "plan for qwen3-32b" in out
    assert main([*argv, "--vram-budget", flag]) == 0
    capsys.readouterr()
    assert main([*argv, "--vram-budget", below]) == 2  # the planner refuses the budget one step below
    assert f"use --vram-budget {flag} or more" in capsys.readouterr().err


def test_poros_plan_prints_the_longest_sequence_and_its_plan(capsys):
    argv = ["plan", "--model", "qwen3-32b", "--vram-budget", "24GB", *LONG_FLAGS]
    assert main([*argv, "--longest-seq-len", "--seq-len-step", "2048", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    n = found["longest_seq_len"]
    assert n % 2048 == 0 and found["seq_len_step"] == 2048 and found["monotone"] and found["out_of_order"] == []
    assert found["max_position_embeddings"] == 40960 and found["plan"]["process_vram_bytes"] <= 24 * 10**9
    assert [n, True] in found["tried"] and [n + 2048, False] in found["tried"]
    assert main([*argv, "--longest-seq-len", "--seq-len-step", "2048"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"longest seq_len for qwen3-32b within 24 GB: --seq-len {n} (no plan fits at {n + 2048})"
    assert main([*argv, "--seq-len", str(n)]) == 0
    assert main([*argv, "--seq-len", str(n + 2048)]) == 2
    assert "below the smallest plan" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--smallest-budget", "--longest-seq-len", "--vram-budget", "24GB"],
     "--smallest-budget and --longest-seq-len each search one setting with the other fixed: give one of them"),
    (["--smallest-budget", "--vram-budget", "24GB"], "--smallest-budget searches the budget: drop --vram-budget"),
    (["--longest-seq-len"], "--longest-seq-len finds the longest sequence whose plan fits a budget: give one"),
    (["--longest-seq-len", "--vram-budget", "24GB", "--seq-len", "4096"],
     "--longest-seq-len searches the sequence length: drop --seq-len"),
    (["--budget-step", "1GB"], "--budget-step is the granularity of --smallest-budget"),
    (["--smallest-budget", "--budget-step", "auto"], "--budget-step: expected a size such as 100MB or 1GiB"),
    (["--smallest-budget", "--budget-step", "lots"], "--budget-step: expected a size such as 24GB"),
    (["--longest-seq-len", "--vram-budget", "24GB", "--seq-len-step", "1"], "--seq-len-step: expected an integer >= 2"),
    (["--longest-seq-len", "--vram-budget", "24GB", "--seq-len-step", "x"], "--seq-len-step: expected an integer > 0"),
    (["--seq-len-step", "2048"], "--seq-len-step is the granularity of --longest-seq-len"),
    (["--longest-seq-len", "--vram-budget", "2GB"], "no sequence length fits: vram_budget 2 GB is below the smallest "
                                                    "plan for qwen3-32b at 1024 tokens"),
    (["--longest-seq-len", "--vram-budget", "24GB", "--seq-len-step", "65536"],
     "seq_len_step: 65536 is longer than the longest sequence qwen3-32b takes (40960"),
], ids=["both", "smallest-with-budget", "longest-without-budget", "longest-with-seq-len", "budget-step-alone",
        "budget-step-auto", "budget-step-not-a-size", "seq-len-step-1", "seq-len-step-not-a-number",
        "seq-len-step-alone", "below-at-any-length", "step-beyond-the-model"])
def test_bad_search_flags_are_one_line_errors(capsys, argv, said):
    assert main(["plan", "--model", "qwen3-32b", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("poros plan: error: ") and said in err, err
