"""Sweep pages (poros/harness/sweep_report.py, poros/harness/sweep_plots.py) from small synthetic scripts/sweep.py rows:
which reference a row is compared with, the data-parallel scaling table, which plots a page links."""

from __future__ import annotations

import json
import re

import pytest

from poros.errors import PorosError
from poros.harness.sweep_plots import budget_figure, series
from poros.harness.sweep_report import (ATTENTION_COLUMNS, COLUMNS, SCALING_COLUMNS, attention_pairs, plan_name, scaling_pairs,
                                 write_sweep_report)
from tests.harness.test_report import assert_tables_well_formed, cells


def prov(uuids=("A",), host="h1", time="t1") -> dict:
    return {"gpus": [{"name": "NVIDIA H200", "uuid": u} for u in uuids], "host": host, "git": {"commit": "abc"},
            "torch": "2.11", "versions": {}, "time": time}


def row(method="poros", s=1.0, world=1, seq=512, accum=1, peak=10.0, uuids=("A",), host="h1", time="t1",
        **kw) -> dict:
    """A timed row as scripts/sweep.py writes it; tokens/s from the arguments (batch 1)."""
    r = {"model": "m", "method": method, "attention": "math", "seq_len": seq, "loss_chunk": None, "world_size": world,
         "grad_accum": accum, "s_per_step_median": s, "tokens_per_s": round(world * seq * accum / s, 1),
         "peak_vram_gb": peak, "provenance": prov(uuids, host, time)}
    return {**r, **kw}


def render(tmp_path, rows, name="plans.md") -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = write_sweep_report([path], tmp_path / name).read_text()
    assert_tables_well_formed(md)
    return md


def table(md: str, columns=COLUMNS) -> list[dict]:
    """Rows of the table with `columns` as header, each as {column: cell}."""
    lines = md.splitlines()
    start = lines.index("| " + " | ".join(columns) + " |")
    out = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        out.append(dict(zip(columns, cells(line))))
    return out


def linked(md: str) -> list[str]:
    """The images a page links, in order."""
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


def vs_resident(md: str) -> dict[tuple, str]:
    """`vs resident` per (GPUs, Seq, Grad-accum, Method / plan) of the poros rows."""
    return {(c["GPUs"], c["Seq"], c["Grad-accum"], c["Method / plan"]): c["vs resident"] for c in table(md)
            if c["Method / plan"].startswith("poros")}


def test_ratios_only_against_the_reference_on_the_same_gpu(tmp_path):
    rows = [row("resident", s=1.0, peak=80.0),
            row(s=1.5, vram_budget=24e9, cuda_graphs=True, parity="PASS", parity_steps=2, gate="resident (recorded)",
                predicted_peak_vram_gb=23.5, resident_layers=20, block_size=3, peak=23.0, peak_reserved_gb=26.5),
            row(s=2.0, uuids=("B",)),  # another GPU: no ratio
            {**row(vram_budget="1000000000"), "error": "BudgetError: too small"}]
    md = render(tmp_path, rows)
    got = table(md)
    assert [c["vs resident"] for c in got] == ["1.00×", "1.50×", "—", "—"]
    assert got[1]["Parity (gate)"] == "PASS (2 steps, resident (recorded))"
    assert (got[1]["Peak VRAM"], got[1]["Peak reserved"], got[0]["Peak reserved"]) == ("23.00 GB", "26.50 GB", "—")
    assert got[1]["Method / plan"] == "poros, budget 24 GB, CUDA graphs"
    assert got[2]["Method / plan"] == "poros, every layer streamed"
    assert got[3]["Parity (gate)"] == "not run: too small" and got[3]["Method / plan"] == "poros, budget 1 GB"
    assert set(list(got[3].values())[8:]) == {"—"}
    assert [(c["GPU"], c["Attention"]) for c in got] == [("A", "math"), ("A", "math"), ("B", "math"), ("A", "math")]
    assert (tmp_path / "plans.png").is_file()


def test_ratios_only_against_the_reference_of_the_same_run(tmp_path):
    """Two sweeps on one GPU: each plan meets its own sweep's reference, never the other's."""
    rows = [row("resident", s=1.0), row(s=0.9), row("resident", s=2.0, time="t2"), row(s=1.0, time="t2"),
            row(s=1.0, time="t3")]  # a sweep without a reference: no ratio
    assert [c["vs resident"] for c in table(render(tmp_path, rows))] == ["1.00×", "0.90×", "1.00×", "0.50×", "—"]


def test_baseline_is_keyed_by_seq_len_and_world_size(tmp_path):
    rows = [row("resident", s=1.0), row("resident", s=4.0, seq=2048), row("resident", s=2.0, world=2),
            row(s=1.5), row(s=6.0, seq=2048), row(s=3.0, world=2), row(s=9.0, seq=4096)]
    assert vs_resident(render(tmp_path, rows)) == {
        ("1", "512", "1", "poros, every layer streamed"): "1.50×",
        ("1", "2048", "1", "poros, every layer streamed"): "1.50×",
        ("2", "512", "1", "poros, every layer streamed"): "1.50×",
        ("1", "4096", "1", "poros, every layer streamed"): "—",  # no reference at this length
    }


def test_a_data_parallel_row_is_not_compared_with_a_one_gpu_reference(tmp_path):
    """Negative control of the key: the same rows with the world-2 reference left out give no ratio."""
    md = render(tmp_path, [row("resident", s=1.0), row(s=3.0, world=2), row(s=2.0, accum=8)])
    assert set(vs_resident(md).values()) == {"—"}


def test_plain_resident_is_preferred_to_resident_gc_as_the_baseline(tmp_path):
    rows = [row("resident_gc", s=2.0), row("resident", s=1.0), row(s=3.0),
            row("resident_gc", s=5.0, seq=8192), row(s=10.0, seq=8192)]  # no plain resident at 8192
    md = render(tmp_path, rows)
    assert vs_resident(md) == {("1", "512", "1", "poros, every layer streamed"): "3.00×",
                               ("1", "8192", "1", "poros, every layer streamed"): "2.00×"}


def test_unsloth_and_control_rows(tmp_path):
    rows = [row("resident", s=1.0),
            {**row("resident (control)"), "parity": "PASS", "parity_steps": 2, "gate": "control (recorded)"},
            row("unsloth", s=0.8, unsloth_version="2026.1"),
            {"model": "m", "method": "unsloth", "grad_accum": 8, "seq_len": 512, "world_size": 1,
             "error": "OutOfMemoryError: CUDA out of memory | tried 3 GB\nsee the log", "provenance": prov()}]
    control, unsloth, failed = table(render(tmp_path, rows))[1:]
    assert control["Parity (gate)"] == "PASS (control: reference vs itself, 2 steps)"
    assert set(list(control.values())[8:]) == {"—"}  # parity only: no timing although the row carries a peak
    assert unsloth["Parity (gate)"] == "not gated (other arithmetic)"
    assert (unsloth["s/step"], unsloth["vs resident"], unsloth["Tokens/s"]) == ("0.8000", "0.80×", "640")
    assert failed["Parity (gate)"] == "not run: CUDA out of memory / tried 3 GB see the log"
    assert failed["Grad-accum"] == "8" and set(list(failed.values())[8:]) == {"—"}


def test_scaling_table_ratio_and_efficiency(tmp_path):
    rows = [row(s=1.0, uuids=("A",)), row(s=1.0, world=2, uuids=("A", "B")),
            row(s=1.25, world=4, uuids=("A", "B", "C", "D")),
            row("resident", s=0.5), row("resident", s=0.8, world=2, uuids=("A", "B"))]
    md = render(tmp_path, rows)
    assert "## Data-parallel scaling" in md
    got = {(c["Method / plan"], c["GPUs"]): c for c in table(md, SCALING_COLUMNS)}
    assert set(got) == {("poros, every layer streamed", "2"), ("poros, every layer streamed", "4"), ("resident", "2")}
    plan = "poros, every layer streamed"
    two, four, res = got[(plan, "2")], got[(plan, "4")], got[("resident", "2")]
    assert (two["Tokens/s"], two["Tokens/s on 1 GPU"], two["Speed-up"], two["Per-GPU efficiency"]) == (
        "1024", "512", "2.00×", "100%")
    assert (four["Tokens/s"], four["Speed-up"], four["Per-GPU efficiency"]) == ("1638", "3.20×", "80%")
    assert (res["Tokens/s on 1 GPU"], res["Speed-up"], res["Per-GPU efficiency"]) == ("1024", "1.25×", "62%")
    assert two["GPU"] == "NVIDIA H200" and two["Seq"] == "512"


@pytest.mark.parametrize("other", [
    {"host": "h2"}, {"uuids": ("C",)}, {"seq": 1024}, {"accum": 8}, {"cuda_graphs": True}, {"method": "resident"},
], ids=lambda o: "differs=" + ",".join(o))
def test_scaling_pairs_only_the_same_work_on_the_same_machine(tmp_path, other):
    """A one-GPU row that differs in machine, work or plan from the data-parallel row is no pair."""
    many = row(s=1.0, world=2, uuids=("A", "B"))
    assert scaling_pairs([row(s=1.0), many]) == [(row(s=1.0), many)]  # the control: the same row pairs
    assert scaling_pairs([row(s=1.0, **other), many]) == []
    assert "## Data-parallel scaling" not in render(tmp_path, [row(s=1.0, **other), many])


def test_scaling_ignores_failed_and_control_rows():
    many = row(s=1.0, world=2, uuids=("A", "B"))
    assert scaling_pairs([{**row(s=1.0), "error": "RuntimeError: x"}, many]) == []
    assert scaling_pairs([row(s=1.0), {**many, "method": "poros (control)"}]) == []


def test_only_plots_with_their_data_are_linked(tmp_path):
    budgets = [row("resident", s=1.0, peak=80.0), row("unsloth", s=0.9, peak=40.0),
               row(s=2.0, peak=9.0), row(s=1.5, peak=24.0, vram_budget=24e9)]
    assert linked(render(tmp_path / "a", budgets, "b.md")) == ["b.png"]
    assert sorted(p.name for p in (tmp_path / "a").glob("*.png")) == ["b.png"]

    longer = budgets + [row("resident", s=8.0, accum=8), row(s=15.0, accum=8),
                        row(s=4.0, seq=4096, peak=20.0), row("unsloth", s=3.0, seq=4096, peak=50.0)]
    assert linked(render(tmp_path / "b", longer, "b.md")) == ["b.png", "b-accum.png", "b-seq.png"]
    assert sorted(p.name for p in (tmp_path / "b").glob("*.png")) == ["b-accum.png", "b-seq.png", "b.png"]

    nothing = [row(s=1.0, world=2, uuids=("A", "B"))]
    assert linked(render(tmp_path / "c", nothing, "b.md")) == []
    assert (tmp_path / "c" / "b.png").is_file()  # written all the same: `poros report` names it


def test_series_points_and_labels():
    rows = [row("resident", s=1.0), row("resident", s=4.0, accum=8), row(s=2.0), row(s=8.0, accum=8),
            row(s=1.0, accum=4, seq=1024), row(s=4.0, accum=16, seq=1024),
            row(s=2.0, accum=2, vram_budget=24e9)]  # one point: no line
    got = series(rows, "grad_accum", "tokens_per_s", ("poros", "resident"), ("seq_len", "world_size"))
    assert got == {"m, resident, seq 512": [(1, 512.0), (8, 1024.0)],
                   "m, poros, every layer streamed, seq 512": [(1, 256.0), (8, 512.0)],
                   "m, poros, every layer streamed, seq 1024": [(4, 4096.0), (16, 4096.0)]}
    assert series(rows[:4], "grad_accum", "tokens_per_s", ("poros",), ("seq_len", "world_size")) == {
        "m, poros, every layer streamed": [(1, 256.0), (8, 512.0)]}  # a context field that does not vary goes unnamed


def test_budget_plot_marks_resident_and_unsloth():
    rows = [row("resident", s=1.0, peak=80.0), row("unsloth", s=0.9, peak=40.0), row(s=2.0, peak=9.0),
            row(s=1.5, peak=24.0, vram_budget=24e9), row(s=1.4, peak=30.0, world=2, uuids=("A", "B"))]
    fig, drawn = budget_figure(rows)
    (ax,) = fig.axes
    assert drawn and [list(l.get_xdata()) for l in ax.lines] == [[9.0, 24.0]]  # the world-2 row is no budget point
    assert {c.get_label(): tuple(c.get_offsets()[0]) for c in ax.collections} == {
        "m resident QLoRA": (80.0, 1.0), "m unsloth": (40.0, 0.9)}
    fig, drawn = budget_figure(rows[:3])  # one poros plan: a point, no line, so no plot on the page
    assert [list(l.get_xdata()) for l in fig.axes[0].lines] == [[9.0]] and drawn is False


def test_budget_plot_a_panel_per_length_and_a_line_for_kept_activations():
    rows = [row(s=2.0, peak=9.0), row(s=1.5, peak=24.0, vram_budget=24e9),
            row(s=1.2, peak=40.0, vram_budget=40e9, keep_activations=True),
            row(s=1.1, peak=60.0, vram_budget=60e9, keep_activations=True),
            row(s=30.0, peak=20.0, seq=16384, vram_budget=24e9), row(s=29.0, peak=36.0, seq=16384, vram_budget=40e9),
            row(s=99.0, peak=50.0, seq=32768, vram_budget=40e9)]  # a length with one plan: a panel with a point
    fig, drawn = budget_figure(rows)
    short, long, longest = fig.axes
    assert drawn and [ax.get_title() for ax in fig.axes] == ["s/step against VRAM, seq 512",
                                                             "s/step against VRAM, seq 16384",
                                                             "s/step against VRAM, seq 32768"]
    assert [(l.get_label(), list(l.get_xdata())) for l in short.lines] == [
        ("m poros, recompute", [9.0, 24.0]), ("m poros, resident layers keep activations", [40.0, 60.0])]
    assert [list(l.get_xdata()) for l in long.lines] == [[20.0, 36.0]]
    assert [list(l.get_xdata()) for l in longest.lines] == [[50.0]]


def test_budget_plot_marks_plans_where_some_resident_layers_keep_activations():
    """A plan keeping only some resident layers' activations is no point of the all-kept line: a triangle
    marked with its count."""
    rows = [row(s=1.2, peak=40.0, vram_budget=40e9, keep_activations=True),
            row(s=1.0, peak=60.0, vram_budget=60e9, keep_activations=True),
            row(s=1.25, peak=40.5, vram_budget=40e9, keep_activations=True, kept_layers=20)]
    (ax,) = budget_figure(rows)[0].axes
    assert [list(l.get_xdata()) for l in ax.lines] == [[40.0, 60.0]]
    (marks,) = ax.collections
    assert marks.get_label() == "m poros, some resident layers keep activations"
    assert [tuple(o) for o in marks.get_offsets()] == [(40.5, 1.25)]
    assert [t.get_text() for t in ax.texts] == ["20 kept"]


def test_budget_plot_a_line_per_placement():
    rows = [row(s=1.3, peak=24.0, vram_budget=24e9), row(s=1.1, peak=40.0, vram_budget=40e9),
            row(s=1.2, peak=24.0, vram_budget=24e9, placement="spread"),
            row(s=1.0, peak=40.0, vram_budget=40e9, placement="spread"),
            row(s=0.9, peak=60.0, vram_budget=60e9, placement="tail")]
    (ax,) = budget_figure(rows)[0].axes
    assert [(l.get_label(), list(l.get_xdata()), l.get_linestyle()) for l in ax.lines] == [
        ("m poros, recompute", [24.0, 40.0, 60.0], "-"), ("m poros, recompute, spread placement", [24.0, 40.0], "-.")]


def test_attention_backends_section(tmp_path):
    flash = {"head_dim 128, heads 8/2, causal": "flash"}
    md = render(tmp_path, [row("resident", attention_backends=flash),
                           row(attention_backends={**flash, "head_dim 512, heads 8/8, causal": "efficient"}),
                           row("unsloth")])
    got = table(md, ("Model", "Attention setting", "Layer shape", "Backend", "Methods"))
    assert [(c["Layer shape"], c["Backend"], c["Methods"]) for c in got] == [
        ("head_dim 128, heads 8/2, causal", "flash", "poros, resident"),
        ("head_dim 512, heads 8/8, causal", "efficient", "poros")]
    assert "## Attention backends" not in render(tmp_path / "none", [row("resident"), row()])


def test_budget_plot_a_line_per_attention_setting_and_run():
    """Points of another attention setting or another sweep never join a line; labels say which."""
    rows = [row("resident", s=1.0, peak=80.0), row(s=2.0, peak=9.0), row(s=1.5, peak=24.0, vram_budget=24e9),
            row(s=1.9, peak=9.1, attention="fast"), row(s=1.4, peak=24.1, vram_budget=24e9, attention="fast"),
            row(s=1.8, peak=9.2, attention="fast", time="t2"), row("resident", s=0.9, peak=70.0, attention="fast",
                                                                   time="t2"),
            row(s=1.3, peak=9.3, uuids=("B",), time="t3")]  # alone in its run: a point of its own
    (ax,) = budget_figure(rows)[0].axes
    assert [(l.get_label(), list(l.get_xdata())) for l in ax.lines] == [
        ("m (math) [A t1] poros, recompute", [9.0, 24.0]), ("m (fast) [A t1] poros, recompute", [9.1, 24.1]),
        ("m (fast) [A t2] poros, recompute", [9.2]), ("m (math) [B] poros, recompute", [9.3])]
    assert [c.get_label() for c in ax.collections] == ["m (math) [A t1] resident QLoRA", "m (fast) [A t2] resident QLoRA"]


def test_math_against_the_fast_path(tmp_path):
    """Each row of another attention setting meets the same run on math: same plan, work and GPU."""
    rows = [row("resident", s=1.2, peak=80.0), row(s=1.0, peak=9.0, cuda_graphs=True),
            row("resident", s=1.1, peak=72.0, attention="fast"),
            row(s=0.8, peak=9.1, cuda_graphs=True, attention="fast"),
            row(s=0.7, attention="fast"),  # no math row of this plan
            row(s=0.7, attention="fast", cuda_graphs=True, uuids=("B",)),  # math ran on another GPU
            row(s=0.7, attention="fast", cuda_graphs=True, seq=1024),  # other work
            row(s=0.7, attention="fast", cuda_graphs=True, time="t2")]  # another sweep
    md = render(tmp_path, rows)
    got = table(md, ATTENTION_COLUMNS)
    assert [(c["Method / plan"], c["Attention"], c["s/step"], c["s/step on math"], c["vs math"], c["Tokens/s"],
             c["Tokens/s on math"], c["Peak VRAM"], c["Peak VRAM on math"]) for c in got] == [
        ("resident", "fast", "1.1000", "1.2000", "0.92×", "466", "427", "72.00 GB", "80.00 GB"),
        ("poros, every layer streamed, CUDA graphs", "fast", "0.8000", "1.0000", "0.80×", "640", "512", "9.10 GB",
         "9.00 GB")]
    assert len(attention_pairs(rows)) == 2
    assert "## Attention: math against the fast path" not in render(tmp_path / "none", rows[2:])


@pytest.mark.parametrize("kw,name", [
    ({}, "poros, every layer streamed"),
    ({"vram_budget": 49000000000, "cuda_graphs": True}, "poros, budget 49 GB, CUDA graphs"),
    ({"vram_budget": "auto", "offload_inputs": True}, "poros, budget auto, inputs in host memory"),
    ({"overlap_backward": False, "accumulation": "micro"}, "poros, every layer streamed, serial backward, "
                                                           "micro-major accumulation"),
    ({"accumulation": "layer", "overlap_backward": True}, "poros, every layer streamed"),
    ({"method": "resident_gc (control)"}, "resident_gc (control)"),
    ({"vram_budget": 49000000000, "keep_activations": True, "cuda_graphs": True},
     "poros, budget 49 GB, activations kept, CUDA graphs"),
    ({"vram_budget": 40000000000, "keep_activations": True, "kept_layers": 20},
     "poros, budget 40 GB, activations kept (20 layers)"),
    ({"vram_budget": 40000000000, "placement": "spread", "cuda_graphs": True},
     "poros, budget 40 GB, spread, CUDA graphs"),
    ({"vram_budget": 40000000000, "placement": "tail"}, "poros, budget 40 GB"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_plan_names(kw, name):
    assert plan_name({"method": "poros", **kw}) == name


def test_unreadable_sweep_files_are_one_line_errors(tmp_path):
    with pytest.raises(PorosError, match=r"nope\.jsonl: no such sweep file"):
        write_sweep_report([tmp_path / "nope.jsonl"], tmp_path / "x.md")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row()) + "\n{not json\n")
    with pytest.raises(PorosError, match=r"bad\.jsonl:2: not valid JSON"):
        write_sweep_report([bad], tmp_path / "x.md")


def test_a_row_gated_then_stopped_keeps_its_verdict(tmp_path):
    from poros.harness.sweep_report import sweep_table

    row = {"model": "m", "method": "poros", "grad_accum": 8, "seq_len": 512, "parity": "PASS", "parity_steps": 1,
           "gate": "resident (recorded)", "error": "Stopped: stopped by signal 15 (during timing)",
           "provenance": {"gpus": [{"name": "G", "uuid": "u"}]}}
    line = next(x for x in sweep_table([row]).splitlines() if x.startswith("| m "))
    assert "PASS (1 step, resident (recorded)); not timed: stopped by signal 15 (during timing)" in line
