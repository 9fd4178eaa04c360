"""Sweep pages (`poros report --sweep`, poros/harness/report/) from small fixture rows of schema 2 (made-up
numbers): which reference a row is compared with, the scaling and attention tables, which plots a page links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from poros.cli import main
from poros.harness.matrix import load_matrix
from poros.harness.report.layout import load_manifest
from poros.harness.report import (ATTENTION_COLUMNS, SCALING_COLUMNS, SWEEP_COLUMNS, budget_figure, load_results,
                                  schedule, sweep_rows, write_report)
from tests.harness.test_report import assert_tables_well_formed, cells, fixture_row, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def row(method="poros", s=1.0, gpus=1, seq=512, accum=1, peak=10.0, uuids=("A",), host="h1", run="t1",
        attention="math", plan=None, **kw) -> dict:
    """A timed schema-2 row of one sweep run; tokens/s from the arguments (batch 1)."""
    r = fixture_row(method="poros" if method == "poros" else "resident", run=run, world_size=gpus,
                    s_per_step_median=s, tokens_per_s=round(gpus * seq * accum / s, 1), peak_vram_gb=peak)
    r["method"] = method
    r["plan_name"] = plan or ("streamed" if method == "poros" else None)
    r["parity"] = "PASS" if method == "poros" else None
    r["gate"] = "resident" if method == "poros" else None
    r["config"] = {**r["config"], "seq_len": seq, "grad_accum": accum, "attention": attention, "gpus": gpus,
                   **kw.pop("config", {})}
    r["provenance"] = {**r["provenance"], "host": host,
                       "gpus": [{"name": "NVIDIA H200", "uuid": u} for u in uuids]}
    return {**r, **kw}


def render(tmp_path, rows, name="plans.md") -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    md = write_report([write_jsonl(tmp_path / "rows.jsonl", rows)], tmp_path / name, sweep=True).read_text()
    assert_tables_well_formed(md)
    return md


def table(md: str, columns=SWEEP_COLUMNS) -> list[dict]:
    lines = md.splitlines()
    start = lines.index("| " + " | ".join(columns) + " |")
    out = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        out.append(dict(zip(columns, cells(line))))
    return out


def linked(md: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


def vs_resident(md: str) -> list[str]:
    return [c["vs resident"] for c in table(md)]


def test_ratios_only_against_the_reference_of_the_same_run_on_the_same_gpu(tmp_path):
    rows = [row("resident", s=1.0), row(s=1.5, plan="24GB"), row(s=2.0, uuids=("B",)),  # another GPU: no ratio
            row("resident", s=2.0, run="t2"), row(s=1.0, run="t2"),  # another run on GPU A: its own reference
            row(s=1.0, run="t3")]  # a run without a reference: no ratio
    assert vs_resident(render(tmp_path, rows)) == ["1.00×", "1.50×", "—", "1.00×", "0.50×", "—"]


def test_the_baseline_is_keyed_by_length_accumulation_and_gpus(tmp_path):
    rows = [row("resident", s=1.0), row("resident", s=4.0, seq=2048), row("resident", s=2.0, gpus=2),
            row(s=1.5), row(s=6.0, seq=2048), row(s=3.0, gpus=2), row(s=9.0, seq=4096), row(s=2.0, accum=8)]
    assert vs_resident(render(tmp_path, rows))[3:] == ["1.50×", "1.50×", "1.50×", "—", "—"]


def test_the_baseline_is_keyed_by_the_chunks(tmp_path):
    """A row with mlp_chunk is compared with the reference of the same chunk, and with none where it has none."""
    chunked = {"config": {"mlp_chunk": 4096}}
    rows = [row("resident", s=1.0), row("resident", s=2.0, **chunked), row(s=3.0, **chunked), row(s=3.0),
            row(s=3.0, config={"mlp_chunk": 1024})]
    assert vs_resident(render(tmp_path, rows)) == ["1.00×", "1.00×", "1.50×", "3.00×", "—"]


def test_a_data_parallel_row_is_not_compared_with_a_one_gpu_reference(tmp_path):
    """Negative control of the key: without the two-GPU reference there is no ratio."""
    assert vs_resident(render(tmp_path, [row("resident", s=1.0), row(s=3.0, gpus=2)])) == ["1.00×", "—"]


def test_plain_resident_is_preferred_to_resident_gc(tmp_path):
    rows = [row("resident_gc", s=2.0), row("resident", s=1.0), row(s=3.0),
            row("resident_gc", s=5.0, seq=8192), row(s=10.0, seq=8192)]
    assert vs_resident(render(tmp_path, rows)) == ["2.00×", "1.00×", "3.00×", "1.00×", "2.00×"]


def test_unsloth_control_and_rows_not_measured(tmp_path):
    rows = [row("resident", s=1.0), row("resident", control=True, parity="PASS", parity_steps=2, gate="resident",
                                        s_per_step_median=None),
            row("unsloth", s=0.8),
            row(plan="24GB", status="skipped", error="BudgetError: 24 GB is below the smallest plan | 31 GB", parity=None,
                s_per_step_median=None),
            row(plan="40GB", parity_steps=1, status="skipped", error="Stopped: stopped by signal 15 (during timing)",
                s_per_step_median=None)]
    _, control, unsloth, below, stopped = table(render(tmp_path, rows))
    assert (control["Method / plan"], control["Parity (gate)"]) == (
        "resident (control)", "PASS (control: reference vs itself, 2 steps)")
    assert set(list(control.values())[9:]) == {"—"}
    assert unsloth["Parity (gate)"] == "not gated (other arithmetic)" and unsloth["vs resident"] == "0.80×"
    assert below["Parity (gate)"] == "not run: 24 GB is below the smallest plan | 31 GB"
    assert stopped["Parity (gate)"] == ("PASS (1 step, vs resident); not timed: stopped by signal 15 "
                                        "(during timing)")
    assert set(list(below.values())[9:]) == set(list(stopped.values())[9:]) == {"—"}


def test_a_row_without_the_planners_prediction_shows_dashes(tmp_path):
    """Rows measured before plans were recorded (or by an engine without a planner) hold no predicted peak,
    parts, plan or resident layer count: their prediction columns read —, never nan or another row's figure;
    a row that recorded them shows its own (the control)."""
    parts = {"weight_buffers": 3.949, "resident_weights": 0.0, "lora": 0.421, "dense": 0.016, "saved_inputs": 0.671,
             "transient": 4.699, "templates": 0.0}
    predicted = row(s=1.5, predicted_peak_vram_gb=9.756, predicted_memory_gb=parts, resident_layers=0)
    predicted["plan"] = {"block_size": 4, "h2d_bytes_per_step": 75_556_454_400, "head_resident": False}
    unrecorded = row(s=1.6, plan="previous_engine")  # no prediction keys at all
    nulls = row(s=1.7, plan="older", predicted_peak_vram_gb=None, predicted_memory_gb=None, resident_layers=None)
    nulls["plan"] = None
    md = render(tmp_path, [row("resident", s=1.0), predicted, unrecorded, nulls])
    got = {c["Method / plan"]: c for c in table(md)}
    shown = ("Predicted peak", "Resident layers", "Block")
    assert [got["poros streamed"][k] for k in shown] == ["9.76 GB", "0", "4"]
    for label in ("poros previous_engine", "poros older"):
        assert [got[label][k] for k in shown] == ["—", "—", "—"], got[label]
        assert got[label]["Peak VRAM"] == "10.00 GB" and got[label]["vs resident"] != "—"  # measured: shown
    assert not re.search(r"\bnan\b", md, re.IGNORECASE)
    page = write_report([write_jsonl(tmp_path / "page.jsonl", [fixture_row(method="resident"), unrecorded])],
                        tmp_path / "page.md").read_text()  # the matrix page does not show predictions: renders
    assert not re.search(r"\bnan\b", page, re.IGNORECASE) and "previous_engine" in page


def test_a_parity_fail_makes_the_report_exit_non_zero(tmp_path, capsys):
    path = write_jsonl(tmp_path / "rows.jsonl", [row("resident"), row(parity="FAIL")])
    assert main(["report", path, "-o", str(tmp_path / "p.md"), "--sweep"]) == 1
    assert "1 cell(s) FAIL: qwen2.5-32b poros plan streamed: parity FAIL" in capsys.readouterr().err
    assert main(["report", write_jsonl(tmp_path / "ok.jsonl", [row("resident"), row()]), "-o",
                 str(tmp_path / "q.md"), "--sweep"]) == 0


def test_a_sweep_page_has_no_reference_table(tmp_path, capsys):
    path = write_jsonl(tmp_path / "rows.jsonl", [row()])
    assert main(["report", path, "-o", str(tmp_path / "p.md"), "--sweep", "--reference"]) == 2
    assert "--reference and --sweep" in capsys.readouterr().err


def test_a_repeated_cell_of_one_run_is_replaced_and_other_runs_are_kept(tmp_path):
    rows = [row(s=1.0), row(s=2.0), row(s=3.0, run="t2")]
    assert [c["s/step"] for c in table(render(tmp_path, rows))] == ["2.0000", "3.0000"]


def test_scaling_pairs_the_same_plan_on_one_gpu_of_the_same_machine(tmp_path):
    rows = [row(s=1.0, gpus=2, uuids=("A", "B")), row(s=0.95, uuids=("A", "B")),
            row(s=1.0, gpus=2, uuids=("C", "D"), host="h2"), row(s=0.9, uuids=("E",), host="h2")]  # not its GPUs
    got = table(render(tmp_path, rows), SCALING_COLUMNS)
    assert [(c["GPUs"], c["Tokens/s"], c["Tokens/s on 1 GPU"], c["Speed-up"], c["Per-GPU efficiency"])
            for c in got] == [("2", "1024", "539", "1.90×", "95%")]


def test_math_against_the_fast_path_pairs_the_same_run_plan_and_work(tmp_path):
    rows = [row("resident", s=1.2, peak=80.0), row(s=1.0, peak=9.0),
            row("resident", s=1.1, peak=72.0, attention="fast"), row(s=0.8, peak=9.1, attention="fast"),
            row(s=0.7, attention="fast", plan="24GB"),  # no math row of this plan
            row(s=0.7, attention="fast", uuids=("B",)),  # math ran on another GPU
            row(s=0.7, attention="fast", seq=1024)]  # other work
    md = render(tmp_path, rows)
    got = table(md, ATTENTION_COLUMNS)
    assert [(c["Method / plan"], c["s/step"], c["s/step on math"], c["vs math"]) for c in got] == [
        ("resident", "1.1000", "1.2000", "0.92×"), ("poros streamed", "0.8000", "1.0000", "0.80×")]
    assert "plans-attention.png" in linked(md)


def test_only_plots_with_their_data_are_linked(tmp_path):
    one = render(tmp_path / "one", [row("resident"), row(plan="24GB")])
    assert linked(one) == []
    budgets = render(tmp_path / "b", [row("resident", peak=70.0), row(peak=9.0, s=1.4),
                                      row(plan="24GB", peak=23.0, s=1.2, config={"vram_budget": 24_000_000_000})])
    assert linked(budgets) == ["plans-budget.png"] and (tmp_path / "b" / "plans-budget.png").is_file()
    axes = render(tmp_path / "a", [row(seq=512), row(seq=1024), row(accum=8), row(gpus=2)])
    assert linked(axes) == ["plans-seq.png", "plans-accum.png", "plans-gpus.png"]


def test_budget_plot_a_line_per_kind_of_plan_and_marks_of_the_run(tmp_path):
    rows = [row("resident", peak=70.0), row("unsloth", peak=40.0, s=0.7),
            row(peak=9.0, s=1.4), row(plan="24GB", peak=23.0, s=1.2, config={"vram_budget": 24_000_000_000}),
            row(plan="24GB+kept", peak=24.0, s=1.3, config={"vram_budget": 24_000_000_000, "keep_activations": True}),
            row(plan="40GB+kept", peak=39.0, s=1.1, config={"vram_budget": 40_000_000_000, "keep_activations": True}),
            row("resident", peak=70.0, run="t2")]  # another run without plans: no mark
    (ax,) = budget_figure(sweep_rows(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))).axes
    assert [(line.get_label(), list(line.get_xdata())) for line in ax.lines] == [
        ("qwen2.5-32b poros, recompute", [9.0, 23.0]), ("qwen2.5-32b poros, activations kept", [24.0, 39.0])]
    assert [c.get_label() for c in ax.collections] == ["qwen2.5-32b resident QLoRA", "qwen2.5-32b unsloth"]


@pytest.mark.parametrize("config,words", [
    ({}, "every layer streamed"),
    ({"vram_budget": 49_000_000_000, "cuda_graphs": True}, "budget 49 GB, CUDA graphs"),
    ({"vram_budget": "auto", "offload_inputs": True}, "budget auto, inputs in host memory"),
    ({"offload_inputs": True, "device_inputs": 20}, "every layer streamed, inputs in host memory (the last 20 layers' "
                                                    "on the device)"),
    ({"overlap_backward": False, "accumulation": "micro"}, "every layer streamed, serial backward, micro-major "
                                                           "accumulation"),
    ({"vram_budget": 40_000_000_000, "keep_activations": True, "kept_layers": 20, "placement": "spread"},
     "budget 40 GB, spread, activations kept (20 layers)"),
    ({"vram_budget": 40_000_000_000, "placement": "tail", "accumulation": "layer"}, "budget 40 GB"),
])
def test_schedule_in_words(config, words):
    assert schedule(config) == words


PAGES = load_manifest(ROOT)


@pytest.mark.parametrize("page", [p for p in PAGES if p.sweep], ids=lambda p: f"report={p.name}")
def test_a_sweep_page_reads_schema_2_rows_of_a_matrix_that_measures_it_again(page):
    for path in page.rows_files(ROOT):
        df = load_results([path])
        assert set(df["schema"]) == {2}, path
        for name in set(df["matrix"]):
            assert load_matrix(name).name == name, f"{path}: no matrices/{name}.yaml measures its rows again"


def test_every_committed_plot_is_linked_by_a_page():
    pngs = {p.name for p in (ROOT / "reports").glob("*.png")}
    used = {png for page in PAGES for png in linked((ROOT / page.markdown).read_text())}
    assert pngs == used, f"plots no page links: {sorted(pngs - used)}; links without a plot: {sorted(used - pngs)}"


def test_a_plain_matrix_rows_beside_a_sweeps_render_on_both_pages(tmp_path, capsys):
    """Rows of an older schema (no plan_name, gate, world_size, sweep, attention_backends) in one file beside
    a sweep's in another: what the older rows lack reads as their null on both pages, never NaN."""
    old = [{k: v for k, v in fixture_row(method=m).items()} for m in ("poros", "resident")]
    swept = [row("resident"), row(plan="24GB", attention_backends={"1x40x512x128": "flash"}, control=False)]
    files = [write_jsonl(tmp_path / "plain.jsonl", old), write_jsonl(tmp_path / "sweep.jsonl", swept)]
    for flags in ([], ["--sweep"]):
        out = tmp_path / f"page{len(flags)}.md"
        assert main(["report", *files, "-o", str(out), *flags]) == 0, capsys.readouterr().err
        md = out.read_text()
        assert_tables_well_formed(md)
        assert not re.search(r"\bnan\b", md, re.IGNORECASE), md
    plain = (tmp_path / "page0.md").read_text()
    assert "| 24GB |" in plain and "| — | PASS (0.00e+00) |" in plain, plain


def test_beside_unsloth_pairs_each_plan_with_unsloth_of_the_same_run_work_and_gpu(tmp_path):
    """Tokens/s against Unsloth's, the NVML peak against Unsloth's, the planner's process prediction against the
    NVML peak; an Unsloth row of another GPU (the control) pairs with nothing, and a page without one has no table."""
    from poros.harness.report.sweep import UNSLOTH_COLUMNS

    poros = row(s=2.0, seq=32768, peak_vram_nvml_gb=22.0, predicted_process_vram_gb=23.1)
    unsloth = row(method="unsloth", s=1.0, seq=32768, peak_vram_nvml_gb=66.0)
    (got,) = table(render(tmp_path / "a", [poros, unsloth]), UNSLOTH_COLUMNS)
    assert (got["vs Unsloth"], got["Share of Unsloth's"], got["Predicted vs NVML"]) == ("0.50×", "33%", "+5.0%")
    assert (got["Peak (NVML)"], got["Unsloth peak (NVML)"], got["Predicted (process)"]) == ("22.00 GB", "66.00 GB",
                                                                                           "23.10 GB")
    device = {**unsloth, "peak_vram_nvml_source": "device"}  # NVML counted every process on the GPU
    (got,) = table(render(tmp_path / "c", [poros, device]), UNSLOTH_COLUMNS)
    assert got["Unsloth peak (NVML)"] == "66.00 GB (device)" and got["Peak (NVML)"] == "22.00 GB"
    elsewhere = row(method="unsloth", s=1.0, seq=32768, peak_vram_nvml_gb=66.0, uuids=("B",))
    assert "## Beside Unsloth" not in render(tmp_path / "b", [poros, elsewhere])
