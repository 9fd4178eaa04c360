"""The floor share on report pages (poros/harness/report/floor.py): a streamed step's copy floor (its row's
`copy_floor_s`) and compute floor (the fastest step of the same work with nothing streamed, same run, same GPU),
from fixture rows with made-up numbers."""

from __future__ import annotations

import pytest

from poros.cli import main
from poros.harness.report import load_results, render_markdown
from poros.harness.report.floor import FLOOR_COLUMNS, with_floors
from tests.harness.test_report import assert_tables_well_formed, fixture_row, tables, write_jsonl
from tests.harness.test_report_sweep import render, row, table

LINK, COPY = 50.0, 0.79  # GB/s the probe found; the poros row's weight bytes over it, in seconds
POROS_S, RESIDENT_S = 1.2345, 0.3456  # fixture_row's s/step of the two methods


def probed(**kw) -> dict:
    """The fixture poros row with a link probe and its copy floor."""
    return fixture_row(**{"link_h2d_gbps": LINK, "copy_floor_s": COPY, **kw})


def resident(**kw) -> dict:
    return fixture_row(method="resident", **kw)


def on_gpu(r: dict, uuid: str) -> dict:
    return {**r, "provenance": {**r["provenance"], "gpus": [{**r["provenance"]["gpus"][0], "uuid": uuid}]}}


def with_config(r: dict, **settings) -> dict:
    return {**r, "config": {**r["config"], **settings}}


def floors_of(tmp_path, rows) -> list[tuple]:
    """(method, compute floor, floor share) of every row, as the report layer derives them."""
    df = with_floors(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    return list(zip(df["method"], df["compute_floor_s"], df["floor_share"]))


def time_rows(md: str) -> list[dict]:
    """The rows of the matrix page's time table (the one with a Floor share column), by column name."""
    (found,) = [t for t in tables(md) if "Copy hidden behind compute" in t[0]]
    return [dict(zip(found[0], r)) for r in found[2:]]


@pytest.mark.parametrize("resident_first", [False, True], ids=lambda f: f"resident_first={f}")
def test_the_compute_floor_is_resident_of_the_same_run_and_gpu_whichever_row_comes_first(tmp_path, resident_first):
    rows = [probed(), resident(), fixture_row(method="unsloth")]
    if resident_first:
        rows = rows[1:2] + rows[:1] + rows[2:]
    assert dict((m, (c, s)) for m, c, s in floors_of(tmp_path, rows))["poros"] == (
        RESIDENT_S, max(COPY, RESIDENT_S) / POROS_S)


def test_the_larger_floor_counts(tmp_path):
    """A copy floor below the compute floor: the share is the compute floor's."""
    (poros,) = [x for x in floors_of(tmp_path, [probed(copy_floor_s=0.1), resident()]) if x[0] == "poros"]
    assert poros == ("poros", RESIDENT_S, RESIDENT_S / POROS_S) and RESIDENT_S > 0.1


def test_the_fastest_step_streaming_nothing_is_the_floor_and_unsloth_is_none(tmp_path):
    """A plan that copies no bytes is the same work with nothing streamed: faster than resident, it is the floor.
    Unsloth, faster still, computes other arithmetic and is not."""
    kept = fixture_row(plan_name="100GB", bytes_h2d_per_step=0, s_per_step_median=0.3)
    fast_unsloth = fixture_row(method="unsloth", s_per_step_median=0.01)
    streamed = probed(plan_name="24GB")
    got = {(m, c) for m, c, _ in floors_of(tmp_path, [streamed, kept, resident(), fast_unsloth])}
    assert ("poros", 0.3) in got
    # negative control: without the plan that streams nothing, resident is the floor again
    got = {(m, c) for m, c, _ in floors_of(tmp_path, [streamed, resident(), fast_unsloth])}
    assert ("poros", RESIDENT_S) in got


GC_S = 0.4321  # resident_gc's made-up s/step: resident's and a forward of every layer again


def resident_gc(**kw) -> dict:
    return {**fixture_row(method="resident"), "method": "resident_gc", "s_per_step_median": GC_S, **kw}


def test_the_recompute_counts_a_plan_recomputing_every_layer_is_held_to_resident_gc(tmp_path):
    """poros recomputes every streamed layer's forward in its backward, as resident_gc does and resident QLoRA does
    not: where the run has both, the streamed row's compute floor is resident_gc's step, slower than resident's."""
    got = dict((m, (c, s)) for m, c, s in floors_of(tmp_path, [probed(copy_floor_s=0.1), resident(), resident_gc()]))
    assert got["poros"] == (GC_S, GC_S / POROS_S) and GC_S > RESIDENT_S
    # negative control: without resident_gc the floor is resident's, the recompute left beyond it
    got = dict((m, (c, s)) for m, c, s in floors_of(tmp_path, [probed(copy_floor_s=0.1), resident()]))
    assert got["poros"] == (RESIDENT_S, RESIDENT_S / POROS_S)


def test_a_plan_keeping_activations_is_floored_in_proportion_to_the_layers_it_recomputes(tmp_path):
    """16 of 64 layers resident and keeping their activations: the floor is resident's step plus three quarters of
    what recomputing every layer adds; keeping 4 of them (`kept_layers`) recomputes 60 of 64."""
    plan = {"resident_layers": list(range(48, 64)), "streamed_layers": list(range(48))}
    kept = with_config(probed(copy_floor_s=0.1, plan=plan), keep_activations=True)
    (poros,) = [c for m, c, _ in floors_of(tmp_path, [kept, resident(), resident_gc()]) if m == "poros"]
    assert poros == pytest.approx(RESIDENT_S + 0.75 * (GC_S - RESIDENT_S))
    four = with_config(kept, kept_layers=4)
    (poros,) = [c for m, c, _ in floors_of(tmp_path, [four, resident(), resident_gc()]) if m == "poros"]
    assert poros == pytest.approx(RESIDENT_S + 60 / 64 * (GC_S - RESIDENT_S))
    # negative control: the same plan without keep_activations recomputes every layer
    (poros,) = [c for m, c, _ in floors_of(tmp_path, [probed(copy_floor_s=0.1, plan=plan), resident(), resident_gc()])
                if m == "poros"]
    assert poros == GC_S
    # `keep_activations: auto`: the search chose the kept layers, which the row's plan records (8 of 64 here)
    auto = with_config(probed(copy_floor_s=0.1, plan={**plan, "kept_layers": list(range(56, 64))}),
                       keep_activations="auto")
    (poros,) = [c for m, c, _ in floors_of(tmp_path, [auto, resident(), resident_gc()]) if m == "poros"]
    assert poros == pytest.approx(RESIDENT_S + 56 / 64 * (GC_S - RESIDENT_S))
    none_kept = with_config(probed(copy_floor_s=0.1, plan={**plan, "kept_layers": []}), keep_activations="auto")
    (poros,) = [c for m, c, _ in floors_of(tmp_path, [none_kept, resident(), resident_gc()]) if m == "poros"]
    assert poros == GC_S


def test_only_a_recomputing_reference_is_the_floor_of_every_plan(tmp_path):
    """A run with resident_gc alone: its step is the floor (the one there is)."""
    got = dict((m, c) for m, c, _ in floors_of(tmp_path, [probed(copy_floor_s=0.1), resident_gc()]))
    assert got["poros"] == GC_S


@pytest.mark.parametrize("other", [
    lambda r: on_gpu(r, "GPU-other-uuid"),
    lambda r: {**r, "provenance": {**r["provenance"], "host": "other-host"}},
    lambda r: {**r, "matrix": "other-matrix"},
    lambda r: {**r, "run": "another run"},
    lambda r: {**r, "stack": "torch 2.10.0+cu128 / transformers 5.5.0"},
    lambda r: with_config(r, seq_len=1024),
    lambda r: with_config(r, attention="fast"),
    lambda r: with_config(r, compile=True),
    lambda r: with_config(r, lora_compute="bf16"),
    lambda r: with_config(r, loss_chunk=256),
    lambda r: with_config(r, grad_accum=8),
    lambda r: {**r, "model": "qwen3-32b"},
    lambda r: {**r, "status": "failed", "s_per_step_median": None},
    lambda r: {**r, "control": True},
], ids=["other-gpu", "other-host", "other-matrix", "other-run", "other-stack", "other-seq-len", "other-attention",
        "other-compile", "other-lora-compute", "other-loss-chunk", "other-grad-accum", "other-model", "not-timed",
        "control"])
def test_a_resident_row_of_other_work_or_another_run_or_gpu_is_not_the_floor(tmp_path, other):
    """Negative control: the only resident row differs in one way; the poros row keeps its copy floor alone."""
    got = floors_of(tmp_path, [probed(), other(resident())])
    assert got[0] == ("poros", None, COPY / POROS_S)
    # ... and the same rows with that resident row as it was pair up
    assert floors_of(tmp_path, [probed(), resident()])[0] == ("poros", RESIDENT_S, COPY / POROS_S)


def test_without_a_resident_row_the_share_is_the_copy_floors(tmp_path):
    assert floors_of(tmp_path, [probed()]) == [("poros", None, COPY / POROS_S)]


def test_rows_without_a_probe_get_no_floor(tmp_path):
    """Rows from before the probe: no floor, no share, and the matrix page's time table keeps its columns."""
    got = floors_of(tmp_path, [fixture_row(), resident()])
    assert all(c is None and s is None for _, c, s in got)
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", [fixture_row(), resident()])))
    assert_tables_well_formed(md)
    assert "Floor share" not in md and list(time_rows(md)[0]) == [
        "Model", "Stack", "Host→device per step", "Copy GB/s (weights)", "Copy hidden behind compute", "Tokens/s"]


def test_the_matrix_page_shows_link_floors_and_share(tmp_path):
    rows = [probed(), resident(), fixture_row(method="unsloth")]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    assert_tables_well_formed(md)
    (r,) = time_rows(md)
    assert [r[c] for c in FLOOR_COLUMNS] == ["50.0 GB/s", "0.7900 s", "0.3456 s", f"{COPY / POROS_S * 100:.0f}%",
                                             f"{POROS_S - COPY:+.4f} s", "—", "—"]  # resident's floor: no schedule
    assert r["Floor share"] == "64%" and r["Beyond the floor"] == "+0.4445 s"  # 1.2345 s less the copy floor
    assert "Floor share: the larger of a step's two floors over its s/step" in md


def test_a_plan_without_a_probe_beside_one_with_it_reads_dashes(tmp_path):
    rows = [probed(plan_name="streamed"), fixture_row(plan_name="24GB"), resident()]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    assert_tables_well_formed(md)
    by_plan = {r["Model"]: r for r in time_rows(md)}
    assert by_plan["qwen2.5-32b (plan streamed)"]["Floor share"] == "64%"
    assert [by_plan["qwen2.5-32b (plan 24GB)"][c] for c in FLOOR_COLUMNS] == ["—"] * len(FLOOR_COLUMNS)


FLOOR_TABLE = ("Model", "GPUs", "GPU", "Seq", "Method / plan", "Schedule", "s/step", *FLOOR_COLUMNS)


def test_the_sweep_page_lists_each_streamed_step_against_its_floors(tmp_path):
    rows = [row(s=2.0, link_h2d_gbps=LINK, copy_floor_s=1.5), row("resident", s=0.5),
            row(s=4.0, seq=4096, plan="long", link_h2d_gbps=LINK, copy_floor_s=1.5),  # no resident at 4096
            row(s=3.0, uuids=("B",), link_h2d_gbps=LINK, copy_floor_s=1.5)]  # another GPU, no resident there
    md = render(tmp_path, rows)
    assert "## Against the floors" in md
    got = [(r["Seq"], r["Method / plan"], r["GPU"], r["Compute floor"], r["Floor share"]) for r in table(md, FLOOR_TABLE)]
    assert got == [("512", "poros streamed", "A", "0.5000 s", "75%"), ("4096", "poros long", "A", "—", "38%"),
                   ("512", "poros streamed", "B", "—", "50%")]


def test_a_sweep_page_without_probes_has_no_floor_section(tmp_path):
    md = render(tmp_path, [row(), row("resident", s=0.5)])
    assert "Against the floors" not in md and "Floor share" not in md


def test_a_probe_that_is_not_a_number_is_a_one_line_error(tmp_path, capsys):
    path = write_jsonl(tmp_path / "r.jsonl", [probed(link_h2d_gbps="fast"), resident()])
    assert main(["report", path, "-o", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:1: field link_h2d_gbps: expected a number or null" in err, err


def test_a_streamed_row_shows_its_schedule_floor_where_its_plan_is_the_one_it_ran(tmp_path):
    """The committed qwen3-32b run (results/h100-fastest/qwen3-32b-run2): each streamed row's schedule floor lies
    between its larger floor and its step, and what lies beyond it is the step less it. Negative controls: a row whose
    recorded plan is not the one its settings make now (a resident layer more) shows none, and neither does a run
    whose compute floor recomputes nothing (resident QLoRA's alone: the recompute's share is not extrapolated)."""
    import json
    from pathlib import Path

    run = Path(__file__).resolve().parents[2] / "results/h100-fastest/qwen3-32b-run2/results.jsonl"
    rows = [json.loads(line) for line in run.read_text().splitlines()]
    df = with_floors(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    streamed = df[df["floor_share"].notna()].to_dict("records")
    assert len(streamed) == 4
    for r in streamed:
        bound = max(r["copy_floor_s"], r["compute_floor_s"])
        assert bound < r["schedule_floor_s"] < r["s_per_step_median"], r["plan_name"]
        assert r["beyond_schedule_s"] == pytest.approx(r["s_per_step_median"] - r["schedule_floor_s"])
    moved = [{**r, "plan": {**r["plan"], "resident_layers": [0, *r["plan"]["resident_layers"]]}}
             if r.get("plan_name") == "half" else r for r in rows]
    df = with_floors(load_results(write_jsonl(tmp_path / "moved.jsonl", moved)))
    half = df[df["plan_name"] == "half"].iloc[0]
    assert half["floor_share"] is not None and half["schedule_floor_s"] is None
    without = [r for r in rows if r.get("plan_name") != "unstreamed"]  # resident's step the only compute floor
    df = with_floors(load_results(write_jsonl(tmp_path / "without.jsonl", without)))
    assert df["floor_share"].notna().sum() == 4 and df["schedule_floor_s"].isna().all()


def test_a_row_whose_plan_cannot_be_built_again_shows_no_schedule_and_the_page_renders():
    """A row of a model this checkout does not know has no schedule floor (—), never an error on the page; the same
    row of a known model has one (the control), and so does a row whose budget no plan fits here: its schedule is
    the plan's it ran, built again with the residency it records."""
    import json
    from pathlib import Path

    from poros.harness.report.schedule import schedule_floor

    run = Path(__file__).resolve().parents[2] / "results/h100-fastest/qwen3-32b-run2/results.jsonl"
    row = next(r for r in map(json.loads, run.read_text().splitlines()) if r.get("plan_name") == "streamed")
    assert schedule_floor(row, 0.2931) is not None
    unknown = {**row, "config": {**row["config"], "model": "no-such-model"}}
    tiny = {**row, "config": {**row["config"], "vram_budget": 1000}}  # 1 kB: below every plan (BudgetError)
    assert schedule_floor(unknown, 0.2931) is None
    assert schedule_floor(tiny, 0.2931) == schedule_floor(row, 0.2931)


def test_a_plan_the_planner_no_longer_makes_is_built_again_as_it_ran(monkeypatch):
    """A planner whose memory model changed (a larger CUDA-graph pool here) makes another plan within the row's
    12 GB budget; the schedule floor is still the plan's that ran, built again with its recorded residency, the
    same figure as before. Negative control: a recorded residency the placement cannot make (layer 0 resident
    beside the last seven) shows none."""
    import importlib
    import json
    from pathlib import Path

    from poros.engine.planning import memory
    schedule = importlib.import_module("poros.harness.report.schedule")
    from poros.engine.planning.budget import make_plan
    from poros.engine.planning.geometry import Geometry
    from poros.models.checkpoint import resolve

    run = Path(__file__).resolve().parents[2] / "results/h100-fastest/qwen3-32b-run2/results.jsonl"
    row = next(r for r in map(json.loads, run.read_text().splitlines()) if r.get("plan_name") == "half")
    before = schedule.schedule_floor(row, 0.2931)
    schedule._rebuilt.cache_clear()
    monkeypatch.setattr(memory, "GRAPH_POOL_PER_LAYER_COMPILED", 2 * memory.GRAPH_POOL_PER_LAYER_COMPILED)
    cfg = schedule.TrainConfig.from_settings(row["config"], model=row["config"]["model"])
    geo = Geometry.of_config(cfg.model, resolve(cfg.model).config, cfg.lora_targets, cfg.double_quant)
    assert make_plan(geo, cfg).resident_layers != row["plan"]["resident_layers"]  # the search makes another plan
    try:
        assert before is not None and schedule.schedule_floor(row, 0.2931) == before
        moved = {**row, "plan": {**row["plan"], "resident_layers": [0, *row["plan"]["resident_layers"]]}}
        assert schedule.schedule_floor(moved, 0.2931) is None
    finally:
        schedule._rebuilt.cache_clear()


def test_a_kept_plan_the_planner_no_longer_makes_is_built_again_from_its_kept_layers(monkeypatch):
    """qwen3-32b within 20 GB keeping 8 layers' activations, its plan recorded as a row records it: after the planner
    changes (a larger CUDA-graph pool: fewer resident layers) the plan is built again as it ran, its recomputed layers
    (all but the kept ones) placing the saved inputs as recorded. Negative control: a row that does not record its
    kept layers cannot be (its saved inputs come out placed for every layer recomputing)."""
    import importlib

    from poros.engine.planning import memory
    from poros.engine.planning.budget import make_plan
    from poros.engine.planning.geometry import Geometry
    from poros.models.checkpoint import resolve

    schedule = importlib.import_module("poros.harness.report.schedule")
    cfg = schedule.TrainConfig(model="qwen3-32b", device="cuda", compile=True, lora_compute="bf16", attention="fast",
                               deterministic=True, cuda_graphs=True, vram_budget="20GB", keep_activations=True,
                               kept_layers=8, placement="spread")
    geo = Geometry.of_config(cfg.model, resolve(cfg.model).config, cfg.lora_targets, cfg.double_quant)
    ran = make_plan(geo, cfg)
    assert len(ran.kept_layers) == 8 and ran.host_inputs
    row = {"method": "poros", "plan": ran.summary(), "config": cfg.as_dict()}
    schedule._rebuilt.cache_clear()
    monkeypatch.setattr(memory, "GRAPH_POOL_PER_LAYER_COMPILED", 2 * memory.GRAPH_POOL_PER_LAYER_COMPILED)
    try:
        assert make_plan(geo, cfg).resident_layers != ran.resident_layers
        rebuilt = schedule.plan_as_ran(row)
        assert rebuilt is not None and rebuilt[0].resident_layers == ran.resident_layers
        unrecorded = {**row, "plan": {k: v for k, v in row["plan"].items() if k != "kept_layers"}}
        assert schedule.plan_as_ran(unrecorded) is None
    finally:
        schedule._rebuilt.cache_clear()


def test_a_probe_that_read_low_gives_way_to_the_rate_the_runs_copies_reached(tmp_path):
    """The probe found 50 GB/s, a step's weight copies reached 55: the link carried 55 at least, so the copy floor of
    every streamed row of that run is its weight bytes over 55 GB/s (the Link column shows it) and no share reads
    above 100%. Negative controls: copies slower than the probe leave the probe's floor, and a faster rate on
    another GPU lends nothing to this one."""
    weights = int(0.8 * LINK * 1e9)  # 0.8 s a step over the probe
    fast = probed(weight_bytes_h2d_per_step=weights, copy_gbps=55.0, plan_name="streamed", s_per_step_median=0.85)
    slow = probed(weight_bytes_h2d_per_step=weights, copy_gbps=45.0, plan_name="other", s_per_step_median=0.95)
    elsewhere = on_gpu(probed(weight_bytes_h2d_per_step=weights, copy_gbps=60.0, plan_name="streamed",
                                s_per_step_median=0.95), "B")
    df = with_floors(load_results(write_jsonl(tmp_path / "r.jsonl", [fast, slow, elsewhere, resident()])))
    got = {(r["plan_name"], r["provenance"]["gpus"][0]["uuid"]): (r["link_gbps"], r["copy_floor_s"], r["floor_share"])
           for r in df.to_dict("records") if r["method"] == "poros"}
    (this_gpu,) = {uuid for _, uuid in got} - {"B"}
    at_55 = weights / 55e9
    assert got[("streamed", this_gpu)] == pytest.approx((55.0, at_55, at_55 / 0.85))
    assert got[("other", this_gpu)] == pytest.approx((55.0, at_55, at_55 / 0.95))  # the run's figure, not its own
    assert got[("streamed", "B")] == pytest.approx((60.0, weights / 60e9, weights / 60e9 / 0.95))
    assert all(share <= 1.0 for _, _, share in got.values())
    only_slow = with_floors(load_results(write_jsonl(tmp_path / "slow.jsonl", [slow, resident()])))
    (row,) = [r for r in only_slow.to_dict("records") if r["method"] == "poros"]
    assert (row["link_gbps"], row["copy_floor_s"]) == pytest.approx((LINK, weights / (LINK * 1e9)))
    probe_only = with_floors(load_results(write_jsonl(tmp_path / "probe.jsonl",
                                                      [probed(copy_floor_s=0.1), resident()])))
    assert probe_only[probe_only["method"] == "poros"]["copy_floor_s"].tolist() == [0.1]  # no weight bytes: as recorded


def test_the_link_figure_is_the_best_rate_seen():
    from poros.harness.link import copy_floor, link_figure

    assert link_figure([50.0, 55.0, None, 45.0]) == 55.0
    assert link_figure([50.0, 45.0]) == 50.0
    assert link_figure([None]) is None and link_figure([None, 0.0, -1.0]) is None
    assert copy_floor(55_000_000_000, link_figure([50.0, 55.0])) == pytest.approx(1.0)
