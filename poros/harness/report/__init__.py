"""Validation reports: Markdown tables and PNGs rendered purely from saved results (JSON Lines) — the one
renderer. `rows` reads and checks results and reference files, `format` shows values, `tables` builds a
matrix page's tables, `sweep` a sweep page's, `plots` draws the PNGs, `pages` assembles and writes pages."""

from __future__ import annotations

from poros.harness.report.pages import failures, render_markdown, render_sweep_markdown, write_report
from poros.harness.report.plots import axis_figure, budget_figure, figure, plot, plot_title, sweep_figures
from poros.harness.report.rows import (
    OFFICIAL_REFERENCE,
    latest,
    load_reference,
    load_results,
    on_cpu,
)
from poros.harness.report.sweep import (
    ATTENTION_COLUMNS,
    SCALING_COLUMNS,
    SWEEP_COLUMNS,
    schedule,
    sweep_rows,
    sweep_table,
)
from poros.harness.report.tables import results_table, spread, timing_warning

__all__ = [
    "ATTENTION_COLUMNS", "OFFICIAL_REFERENCE", "SCALING_COLUMNS", "SWEEP_COLUMNS", "axis_figure",
    "budget_figure", "failures", "figure", "latest", "load_reference", "load_results", "on_cpu",
    "plot", "plot_title", "render_markdown", "render_sweep_markdown", "results_table", "schedule", "spread",
    "sweep_figures", "sweep_rows", "sweep_table", "timing_warning", "write_report",
]
