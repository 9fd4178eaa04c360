"""The plots of a sweep page (poros/harness/sweep_report.py): s/step against VRAM budget, tokens/s against gradient
accumulation, peak VRAM against sequence length. Each returns whether the rows held what it needs
(a line of two or more points); only the first is written without one."""

from __future__ import annotations

from pathlib import Path

from poros.harness.sweep_rows import (
    REFERENCES,
    field,
    gpu_label,
    is_timed,
    plan_name,
    run_of,
)

# marks beside a budget line: (marker, label)
MARKS = {"resident": ("*", "resident QLoRA"), "resident_gc": ("P", "resident_gc"), "unsloth": ("D", "unsloth")}
# the budget plot's lines of poros plans: (activations kept, placement) -> (line style, label)
LINES = {(False, "tail"): ("-", "recompute"), (False, "spread"): ("-.", "recompute, spread placement"),
         (True, "tail"): ("--", "resident layers keep activations"),
         (True, "spread"): (":", "resident layers keep activations, spread placement")}
LABELS = {"seq_len": "seq {}", "grad_accum": "grad-accum {}", "world_size": "{} GPUs"}


def series(rows: list[dict], x: str, y: str, methods: tuple[str, ...], context: tuple[str, ...]) -> dict[str, list]:
    """Sorted (x, y) points per model, method/plan and `context` fields, for timed rows of `methods`; only
    lines of two or more points. A label names a context field only where the lines differ in it."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        if r["method"] in methods and is_timed(r) and field(r, x) is not None and r.get(y) is not None:
            key = (r["model"], plan_name(r), *(field(r, c) for c in context))
            groups.setdefault(key, {})[field(r, x)] = r[y]  # a repeated point: the later row
    lines = {k: sorted(v.items()) for k, v in groups.items() if len(v) >= 2}
    varying = [i for i, _ in enumerate(context) if len({k[2 + i] for k in lines}) > 1]
    return {", ".join([k[0], k[1], *(LABELS[context[i]].format(k[2 + i]) for i in varying)]): pts
            for k, pts in lines.items()}


def _axes():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _finish(fig, ax, legend_loc: str = "best", **labels) -> None:
    ax.set(**labels)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        if legend_loc == "below":  # many lines: the legend under the axes, never over a point
            n = len(ax.get_legend_handles_labels()[0])
            width, height = fig.get_size_inches()
            fig.set_size_inches(width, max(height, 5 + 0.17 * n))
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
        else:
            ax.legend(fontsize=8, loc=legend_loc)
    fig.tight_layout()


def _kept(r: dict) -> bool:
    return r.get("keep_activations") in (True, "True")


def run_label(r: dict, shared_gpu: bool) -> str:
    """A line's run: its GPU, and the run's start (hh:mm) where another run on that GPU is in the panel."""
    if not shared_gpu:
        return gpu_label(r)
    start = str(run_of(r)[1])
    return f"{gpu_label(r)} {start[11:16] if len(start) > 16 and start[10] == 'T' else start}"


def _some_kept(r: dict) -> bool:
    return _kept(r) and r.get("kept_layers") is not None


def budget_figure(rows: list[dict]):
    """s/step against peak VRAM of every poros plan per model, attention setting and run (one GPU,
    grad_accum 1), a panel per sequence length: a line per placement for plans that recompute and for plans
    whose resident layers keep their activations (a lone plan as a point), plans where only some resident
    layers keep theirs (`kept_layers`) as triangles marked with that count; the reference's and Unsloth's
    s/step and peak of the same run as marks. A label names the attention setting or the GPU only where
    lines differ in it. Returns the figure and whether it has a line (two plans or more of one kind in one
    run: a page of lone plans names no plot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def group(r):
        return r["model"], r.get("seq_len"), r.get("attention"), run_of(r)

    def one(g):
        return [r for r in rows if group(r) == g and is_timed(r) and r.get("peak_vram_gb") is not None
                and field(r, "grad_accum") == 1 and field(r, "world_size") == 1]

    def points(rs, kept, placement):
        return sorted((r["peak_vram_gb"], r["s_per_step_median"]) for r in rs
                      if r["method"] == "poros" and _kept(r) == kept and (r.get("placement") or "tail") == placement
                      and not _some_kept(r))

    timed = {g: one(g) for g in dict.fromkeys(map(group, rows))}  # each group's rows, selected once
    timed = {g: rs for g, rs in timed.items() if any(r["method"] == "poros" for r in rs)}
    groups = list(timed)
    has_line = any(len(points(timed[g], *line)) >= 2 for g in groups for line in LINES)
    seqs = sorted({g[1] for g in groups}, key=lambda s: s or 0)
    fig = Figure(figsize=(8 if len(seqs) < 2 else 6 * len(seqs), 5))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, max(1, len(seqs)), i + 1) for i in range(max(1, len(seqs)))]
    for ax, seq in zip(axes, seqs):
        panel = [g for g in groups if g[1] == seq]
        gpus = [(g[0], gpu_label(timed[g][0])) for g in panel]
        shared = {g for g, k in zip(panel, gpus) if len({h[3] for h, j in zip(panel, gpus) if j == k}) > 1}
        for g in panel:
            rs, color = timed[g], None
            name = " ".join([g[0], *([f"({g[2]})"] if len({h[2] for h in panel}) > 1 else []),
                             *([f"[{run_label(rs[0], shared_gpu=g in shared)}]"]
                               if len({h[3] for h in panel if h[0] == g[0]}) > 1 else [])])
            for (kept, placement), (style, how) in LINES.items():
                pts = points(rs, kept, placement)
                if pts:
                    line, = ax.plot(*zip(*pts), marker="o", color=color, linestyle=style, label=f"{name} poros, {how}")
                    color = line.get_color()
            some = [r for r in rs if r["method"] == "poros" and _some_kept(r)]
            if some:
                marks = ax.scatter([r["peak_vram_gb"] for r in some], [r["s_per_step_median"] for r in some], marker="^",
                                   color=color, label=f"{name} poros, some resident layers keep activations")
                color = color or marks.get_facecolor()[0]
                for r in some:
                    ax.annotate(f"{r['kept_layers']} kept", (r["peak_vram_gb"], r["s_per_step_median"]),
                                textcoords="offset points", xytext=(6, -4), fontsize=8)
            for r in rs:
                if r["method"] in MARKS:
                    ax.scatter([r["peak_vram_gb"]], [r["s_per_step_median"]], s=120, color=color,
                               marker=MARKS[r["method"]][0], label=f"{name} {MARKS[r['method']][1]}")
        _finish(fig, ax, "below", xlabel="peak VRAM (GB, torch max allocated)", ylabel="s/step (median)",
                title=f"s/step against VRAM, seq {seq}" if len(seqs) > 1 else "s/step against VRAM")
    if not seqs:
        _finish(fig, axes[0], xlabel="peak VRAM (GB, torch max allocated)", ylabel="s/step (median)",
                title="s/step against VRAM")
    return fig, has_line


def plot_budgets(rows: list[dict], png: Path) -> bool:
    """The budget figure, always written (`poros report` names it); True when it has a line."""
    fig, drawn = budget_figure(rows)
    fig.savefig(png, dpi=120)
    return drawn


def _plot_lines(lines: dict[str, list], png: Path, log2_x: bool, **labels) -> bool:
    if not lines:
        return False
    fig, ax = _axes()
    for label, pts in lines.items():
        ax.plot(*zip(*pts), marker="o", label=label)
    if log2_x:  # ticks at the measured values, written plainly (8, not 2^3)
        xs = sorted({x for pts in lines.values() for x, _ in pts})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
    _finish(fig, ax, **labels)
    fig.savefig(png, dpi=120)
    return True


def plot_accumulation(rows: list[dict], png: Path) -> bool:
    """Tokens/s against gradient accumulation (log2) per model and poros plan or reference."""
    lines = series(rows, "grad_accum", "tokens_per_s", ("poros", *REFERENCES), ("seq_len", "world_size"))
    return _plot_lines(lines, png, True, xlabel="gradient accumulation (micro-batches per step)",
                       ylabel="tokens/s", title="Tokens/s against gradient accumulation")


def plot_seq_len(rows: list[dict], png: Path) -> bool:
    """Peak VRAM against sequence length per model and poros plan, reference or Unsloth."""
    lines = series(rows, "seq_len", "peak_vram_gb", ("poros", *REFERENCES, "unsloth"), ("grad_accum", "world_size"))
    return _plot_lines(lines, png, True, xlabel="sequence length (tokens)", ylabel="peak VRAM (GB)",
                       title="Peak VRAM against sequence length")


# (file-name suffix, heading, plot): the main PNG first
PLOTS = (("", "s/step against VRAM", plot_budgets),
         ("-accum", "Tokens/s against gradient accumulation", plot_accumulation),
         ("-seq", "Peak VRAM against sequence length", plot_seq_len))
