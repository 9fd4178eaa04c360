"""A matrix page's tokens/s and process memory (poros/harness/report/tables.py `memory_table`): each row's tokens/s,
poros's against Unsloth's of the same cell, and the process's NVML peak beside the planner's prediction and the
budget; and the saved inputs a plan put in host memory where the configuration left them off. Fixture rows, made-up
numbers."""

from __future__ import annotations

from poros.harness.report import load_results, render_markdown
from tests.harness.test_report import cpu_row, fixture_row, tables, write_jsonl
from tests.harness.test_report_floor import on_gpu, with_config

PLAN = {"streamed_layers": [0, 1, 2], "resident_layers": [3], "host_inputs": [0, 1, 2]}


def page(tmp_path, rows) -> str:
    return render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))


def memory_rows(md: str) -> dict[str, dict]:
    """The memory table's rows by method."""
    (found,) = [t for t in tables(md) if "Process (NVML)" in t[0]]
    return {r[1]: dict(zip(found[0], r)) for r in found[2:]}


def poros_row(**kw) -> dict:
    return with_config(fixture_row(predicted_process_vram_gb=13.26, **kw), vram_budget=24e9)


def test_tokens_per_s_against_unsloth_and_the_prediction_against_nvml(tmp_path):
    rows = memory_rows(page(tmp_path, [poros_row(), fixture_row(method="unsloth", peak_vram_nvml_gb=26.0)]))
    assert rows["poros"]["Tokens/s"] == "414.7" and rows["unsloth"]["Tokens/s"] == "1481.5"
    assert rows["poros"]["Tokens/s vs unsloth"] == f"{414.7 / 1481.5:.3f}×" and rows["unsloth"]["Tokens/s vs unsloth"] == "—"
    assert rows["poros"]["Process (NVML)"] == "13.00 GB" and rows["poros"]["Predicted (process)"] == "13.26 GB"
    assert rows["poros"]["Process vs unsloth"] == "50.0%" and rows["unsloth"]["Process vs unsloth"] == "—"
    assert rows["poros"]["Predicted vs NVML"] == "+2.0%" and rows["poros"]["VRAM budget"] == "24.00 GB"
    assert rows["unsloth"]["Predicted vs NVML"] == "—" and rows["unsloth"]["VRAM budget"] == "—"


def test_a_ratio_of_rows_from_two_gpus_is_not_printed(tmp_path):
    rows = memory_rows(page(tmp_path, [poros_row(), on_gpu(fixture_row(method="unsloth"), "GPU-other")]))
    assert rows["poros"]["Tokens/s vs unsloth"] == "other GPU"
    assert rows["poros"]["Process vs unsloth"] == "100.0%"  # a process's peak does not move with the host
    # negative control: one GPU, the ratio
    rows = memory_rows(page(tmp_path, [poros_row(), fixture_row(method="unsloth")]))
    assert rows["poros"]["Tokens/s vs unsloth"].endswith("×")


def test_no_memory_table_without_nvml_peaks(tmp_path):
    assert "Process (NVML)" not in page(tmp_path, [poros_row(peak_vram_nvml_gb=None), fixture_row(
        method="unsloth", peak_vram_nvml_gb=None)])
    assert "Process (NVML)" not in page(tmp_path, [cpu_row(), cpu_row(method="resident")])


def test_saved_inputs_the_plan_put_in_host_memory_are_shown_as_planned(tmp_path):
    def setting(rows) -> str:
        found = [r for t in tables(page(tmp_path, rows)) for r in t[2:] if r[0] == "Saved inputs in host memory (poros)"]
        return found[0][1]

    assert setting([poros_row(plan=PLAN)]) == "on for 3 of 4 layers (planned)"
    assert setting([with_config(poros_row(plan=PLAN), offload_inputs=True)]) == "on"
    # negative control: a plan with every saved input on the device reads as its configuration
    assert setting([poros_row(plan={**PLAN, "host_inputs": []})]) == "off"


def test_a_budget_of_auto_reads_as_the_bytes_its_run_resolved(tmp_path):
    """A row of `vram_budget: auto` (its config keeps the setting asked) shows its plan's budget, the bytes its run
    resolved; the control: a row that streamed every layer shows none."""
    auto = with_config(fixture_row(predicted_process_vram_gb=13.26), vram_budget="auto")
    auto["plan"] = {**(auto.get("plan") or {}), "vram_budget": 121_000_000_000}
    rows = memory_rows(page(tmp_path, [auto, fixture_row(method="unsloth")]))
    assert rows["poros"]["VRAM budget"] == "121.00 GB"
    streamed = with_config(fixture_row(predicted_process_vram_gb=13.26), vram_budget=None)
    assert memory_rows(page(tmp_path, [streamed, fixture_row(method="unsloth")]))["poros"]["VRAM budget"] == "—"
