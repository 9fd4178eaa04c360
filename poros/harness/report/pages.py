"""Pages: a matrix page (configuration, results, time, reference, provenance and its plot) and a sweep
page (its tables and plots) from results rows, written as Markdown beside their PNGs."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from poros.common.atomic import atomic_path, write_atomic
from poros.harness.report.floor import FLOOR_NOTE, with_floors
from poros.harness.report.across import across_sections
from poros.harness.report.reference import reference_sections
from poros.harness.report.plots import plot, plot_title, sweep_figures
from poros.harness.report.rows import latest, load_reference, load_results, named_as_reference, on_cpu
from poros.harness.report.sweep import (
    UNSLOTH_NOTE,
    attention_table,
    backends_table,
    floor_table,
    scaling_table,
    sweep_intro,
    sweep_rows,
    sweep_table,
    unsloth_table,
)
from poros.harness.report.tables import (
    config_table,
    provenance_line,
    memory_table,
    protocol_line,
    results_table,
    runs_text,
    time_table,
    timing_warning,
)


def failures(df: pd.DataFrame, sweep: bool = False) -> list[str]:
    """The cells of the latest rows (of a sweep page's, with `sweep`) that FAIL (a failed run or a parity FAIL),
    as `model method` lines."""
    out = []
    for r in (sweep_rows(df) if sweep else latest(df)).to_dict("records"):
        if r["status"] == "failed" or r["parity"] == "FAIL":
            why = "parity FAIL" if r["parity"] == "FAIL" else f"failed: {str(r.get('error') or '')[:120]}"
            out.append(f"{r['model']} {r['method']}{' plan ' + r['plan_name'] if r.get('plan_name') else ''}: {why}")
    return out


def render_markdown(df: pd.DataFrame, reference: pd.DataFrame | None = None, title: str | None = None) -> str:
    """The full report: per hardware a configuration, results, time breakdown and provenance; with a
    reference, its figures beside the measured ones, and the models it lists named as it names them."""
    # the floors from every row, before a later run's row replaces an earlier one's: a row that stays takes its compute
    # floor from its own run, whose reference row a later run may have replaced
    df, parts = latest(with_floors(named_as_reference(df, reference))), []
    for hw, g in df.groupby("hardware", sort=False):
        parts += [f"# {title or 'Poros — Validation Results'} ({hw})", "## Configuration", config_table(g, hw)]
        reduced = g[g["reduced"].astype(bool)]
        if len(reduced):
            parts.append(f"> **Reduced run: {runs_text(reduced)} (the matrix file asks for more) — "
                         "not comparable to full runs.**")
        parts += [f"## Results — {hw}", *filter(None, [protocol_line(g), timing_warning(g)]), results_table(g)]
        if not on_cpu(g):  # no host→device copy to account for on the CPU
            parts += ["## Where the time goes (poros)", time_table(g)]
            memory = memory_table(g)
            if memory:
                parts += ["## Tokens/s and the process's memory", memory]
        parts += across_sections(g, reference)
        if reference is not None:
            parts += reference_sections(g, reference)
        parts.append(provenance_line(g))
    return "\n\n".join(parts) + "\n"


def render_sweep_markdown(df: pd.DataFrame, title: str | None = None, plots=()) -> str:
    """The sweep page: every row, each streamed step against its floors, data-parallel scaling, math against the
    fast path, the attention backends, provenance, then the plots (heading, PNG name) it links."""
    rows = with_floors(sweep_rows(df))
    parts = [f"# {title or 'Poros — plans measured'}", sweep_intro(rows), sweep_table(rows)]
    sections = (("Against the floors", FLOOR_NOTE, floor_table), ("Beside Unsloth", UNSLOTH_NOTE, unsloth_table),
                ("Data-parallel scaling", "Tokens/s under data parallelism against the same plan on one GPU of "
                 "the same machine; per-GPU efficiency is the speed-up divided by the number of GPUs.", scaling_table),
                ("Attention: math against the fast path", "Each method or plan on another attention setting "
                 "against the same run on math (same store, same GPU); `vs math` divides the s/step.",
                 attention_table),
                ("Attention backends", "The SDPA backend each attention shape ran on, as recorded on the first "
                 "step of each timed row.", backends_table))
    for heading, text, make in sections:
        table = make(rows)
        if table:
            parts += [f"## {heading}\n\n{text}", table]
    parts.append(provenance_line(df))
    parts += [f"## {heading}\n\n![{heading}]({png})" for heading, png in plots]
    return "\n\n".join(parts) + "\n"


def write_report(results_paths, out_md, reference_csv=None, title: str | None = None, sweep: bool = False) -> Path:
    """Write the Markdown report and, beside it, the PNG it embeds (same stem, `.png`); with `sweep`, the sweep
    page and a PNG per plot it holds (`STEM-budget.png`, `STEM-seq.png`, `STEM-accum.png`, `STEM-gpus.png`)."""
    df = load_results(results_paths)
    out_md = Path(out_md)
    if sweep:
        out_md.parent.mkdir(parents=True, exist_ok=True)
        links = []
        for suffix, heading, fig in sweep_figures(df):
            png = out_md.with_name(f"{out_md.stem}-{suffix}.png")
            with atomic_path(png, "the plot") as tmp:
                fig.savefig(tmp, dpi=120)
            links.append((heading, png.name))
        write_atomic(out_md, render_sweep_markdown(df, title, links), "the report")
        return out_md
    reference = load_reference(reference_csv) if reference_csv is not None else None
    out_md.parent.mkdir(parents=True, exist_ok=True)
    png = plot(named_as_reference(df, reference), out_md.with_suffix(".png"))
    text = render_markdown(df, reference, title)
    shows = plot_title(df)
    write_atomic(out_md, text + f"\n## {shows}\n\n![{shows}]({png.name})\n", "the report")
    return out_md
