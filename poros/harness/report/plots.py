"""The PNGs pages link: a matrix page's s/step against peak VRAM (or, on a CPU, per model and method),
and a sweep page's plots: budgets, attention settings, and one per swept axis with a line of two points
or more."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from poros.engine.methods.method_info import INFO, NAMES, is_planned
from poros.harness.report.format import num
from poros.harness.report.rows import hardware_of, latest, named
from poros.harness.report.sweep import attention_pairs, schedule_kind, sweep_rows


def plot_title(df: pd.DataFrame) -> str:
    """What the plot shows: s/step against peak VRAM where VRAM was measured, else s/step per model and method."""
    return "s/step vs peak VRAM" if _measured(latest(df))["peak_vram_gb"].notna().any() else \
        "s/step per model and method"


def _measured(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["status"] == "ok") & df["s_per_step_median"].notna()]


def _label(r, many_stacks: bool, many_hw: bool) -> str:
    return r["model"] + (f" / {r['stack'].split(' / ')[0]}" if many_stacks else "") + \
        (f" / {r['hardware']}" if many_hw else "")


def figure(df: pd.DataFrame):
    """The plot of what was measured, coloured by method: with peak VRAM, s/step against it, one labeled
    point per model × method × stack; without (CPU), s/step per model × stack as bars with ± std."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    df = latest(df)
    title = plot_title(df)
    measured = _measured(df)
    fig = Figure(figsize=(8, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    many_stacks, many_hw = df["stack"].nunique() > 1, df["hardware"].nunique() > 1
    colours = dict(zip(NAMES, ("tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:green")))
    if title == "s/step vs peak VRAM":
        ok = measured[measured["peak_vram_gb"].notna()]
        for method, colour in colours.items():
            pts = ok[ok["method"] == method]
            if len(pts):
                ax.scatter(pts["peak_vram_gb"], pts["s_per_step_median"], color=colour, label=method, zorder=2)
            for r in pts.to_dict("records"):
                ax.annotate(_label({**r, "model": named(r["model"], r.get("point"), r.get("plan_name"))},
                                   many_stacks, many_hw),
                            (r["peak_vram_gb"], r["s_per_step_median"]),
                            fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.set(xlabel="peak VRAM (GB, torch max allocated)")
        ax.margins(x=0.2, y=0.1)  # room for the point labels
    else:
        groups = list(dict.fromkeys((r["model"], r["stack"], r["hardware"]) for r in measured.to_dict("records")))
        methods = [m for m in NAMES if m in set(measured["method"])]
        width = 0.8 / max(len(methods), 1)
        for i, method in enumerate(methods):
            rows = {(r["model"], r["stack"], r["hardware"]): r
                    for r in measured[measured["method"] == method].to_dict("records")}
            xs = [n for n, g in enumerate(groups) if g in rows]
            ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in xs],
                   [rows[groups[x]]["s_per_step_median"] for x in xs], width,
                   yerr=[num(rows[groups[x]]["s_per_step_std"]) or 0.0 for x in xs], capsize=3,
                   color=colours[method], label=method, zorder=2)
        ax.set_xticks(range(len(groups)),
                      [_label(dict(model=m, stack=s, hardware=h), many_stacks, many_hw) for m, s, h in groups],
                      fontsize=8, rotation=15 if len(groups) > 4 else 0)
        ax.set(xlabel="model")
        ax.margins(y=0.15)  # room for the legend
    if measured.empty:
        ax.text(0.5, 0.5, "no measured cells", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(title="method")
    ax.set(ylabel="s/step (median across passes)", title=title)
    ax.grid(alpha=0.3, zorder=0)
    fig.tight_layout()
    return fig


def plot(df: pd.DataFrame, png_path) -> Path:
    """Write `figure(df)` as a PNG."""
    from poros.common.atomic import atomic_path

    png_path = Path(png_path)
    with atomic_path(png_path, "the plot") as tmp:
        figure(df).savefig(tmp, dpi=120)
    return png_path


# (axis, column, heading, x label)
AXES = (("seq", "seq_len", "Tokens/s against sequence length", "sequence length (tokens)"),
        ("accum", "grad_accum", "Tokens/s against gradient accumulation", "gradient accumulation (micro-batches per step)"),
        ("gpus", "gpus", "Tokens/s against GPUs", "GPUs (data-parallel ranks)"))
LINE_CONTEXT = ("seq_len", "grad_accum", "attention", "gpus", "stack")  # what else a line of one axis holds fixed
LINE_LABELS = {"seq_len": "seq {}", "grad_accum": "grad-accum {}", "attention": "{} attention", "gpus": "{} GPUs",
               "stack": "{}"}
# each method that is not planned, as a mark beside the plans' lines: (marker, legend name)
MARKS = {i.method.value: (marker, i.short) for marker, i in zip("*PXD", (i for i in INFO.values() if not i.planned))}


def _new_figure(panels: int = 1):
    """A figure of `panels` axes side by side (8 inches wide for one, 6 per panel for more)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8 if panels < 2 else 6 * panels, 5))
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, panels, i + 1) for i in range(panels)]


def _finish(fig, ax, **labels) -> None:
    ax.set(**labels)
    ax.grid(alpha=0.3)
    n = len(ax.get_legend_handles_labels()[0])
    if n:  # the legend under the axes, never over a point
        width, height = fig.get_size_inches()
        fig.set_size_inches(width, max(height, 4 + 0.2 * n))
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    fig.tight_layout()


def axis_lines(rows: pd.DataFrame, x: str) -> dict[str, list]:
    """Tokens/s against `x`: sorted points per model, method/plan, hardware and everything else held fixed,
    lines of two points or more (a repeated point: the later row). A label names a held field only where
    the lines differ in it."""
    context = [c for c in LINE_CONTEXT if c != x]
    timed = rows[rows["timed_ok"] & rows["tokens_per_s"].notna()]
    timed = timed.assign(hardware=[hardware_of(r) for r in timed.to_dict("records")])
    keys = ["model", "label", "hardware", *context]
    lines = {}
    for key, g in timed.groupby([timed[k].astype(str) for k in keys], sort=False):
        pts = g.drop_duplicates(subset=x, keep="last").sort_values(x)
        if len(pts) >= 2:
            lines[key] = list(zip(pts[x], pts["tokens_per_s"]))
    varying = [i for i in range(2, len(keys)) if len({k[i] for k in lines}) > 1]
    return {", ".join([k[0], k[1], *((LINE_LABELS.get(keys[i], "{}").format(k[i])) for i in varying)]): pts
            for k, pts in lines.items()}


def axis_figure(rows: pd.DataFrame, x: str, xlabel: str, title: str):
    """The figure of `axis_lines` (log2 x, ticks at the measured values); None without a line."""
    lines = axis_lines(rows, x)
    if not lines:
        return None
    fig, (ax,) = _new_figure()
    for label, pts in lines.items():
        ax.plot(*zip(*pts), marker="o", label=label)
    xs = sorted({px for pts in lines.values() for px, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(v) for v in xs])
    ax.minorticks_off()
    _finish(fig, ax, xlabel=xlabel, ylabel="tokens/s", title=title)
    return fig


def budget_figure(rows: pd.DataFrame):
    """s/step against peak VRAM of the poros plans of each run and work with two plans or more, a line per kind
    of schedule over their VRAM budgets (a line style per kind, a colour per run and work; a lone plan of its
    kind a point), the reference's and Unsloth's of the same run and work as marks. None when no kind has two
    budgets in one run."""
    timed = rows[rows["timed_ok"] & rows["peak_vram_gb"].notna()]
    poros = timed[timed["method"].map(is_planned).astype(bool)]
    kind = poros.assign(kind=[", ".join(schedule_kind(c)) or "recompute" for c in poros["config"]])
    groups = kind.groupby(["run", "work", "kind"], sort=False)
    if not any(len(g) >= 2 for _, g in groups):
        return None
    # the plans of a run and work with two plans or more (a lone plan at a length of its own is left out)
    groups = [(key, g) for key, g in groups if kind["run"].eq(key[0]).mul(kind["work"].eq(key[1])).sum() >= 2]
    shown = kind[[(r, w) in {k[:2] for k, _ in groups} for r, w in zip(kind["run"], kind["work"])]]

    def name(r) -> str:  # model, and what tells its lines apart: length, attention, GPU, run start
        same = shown[shown["model"] == r["model"]]
        gpu = r["gpu_label"] + (f" {str(r['provenance'].get('time'))[11:16]}"
                                if same[same["gpu"] == r["gpu"]]["run"].nunique() > 1 else "")
        extra = [str(r["attention"]) if shown["attention"].nunique() > 1 else "",
                 f"[{gpu}]" if same["run"].nunique() > 1 else ""]
        return " ".join(x for x in [r["model"], *extra] if x)

    seqs = sorted(shown["seq_len"].unique())  # a panel per sequence length: their s/step differ by orders
    fig, panels = _new_figure(len(seqs))
    axes = dict(zip(seqs, panels))
    colours, styles = {}, {}
    for (run, work, what), g in groups:
        g = g.sort_values("peak_vram_gb")
        style = styles.setdefault(what, ("-", "--", "-.", ":")[len(styles) % 4])
        (line,) = axes[g["seq_len"].iloc[0]].plot(
            g["peak_vram_gb"], g["s_per_step_median"], marker="o", linestyle=style, color=colours.get((run, work)),
            label=f"{name(g.iloc[0].to_dict())} poros, {what}")
        colours[(run, work)] = line.get_color()
    for r in timed[timed["method"].isin(list(MARKS))].to_dict("records"):
        if (r["run"], r["work"]) in colours:
            marker, what = MARKS[r["method"]]
            axes[r["seq_len"]].scatter([r["peak_vram_gb"]], [r["s_per_step_median"]], s=120, marker=marker,
                                       color=colours[(r["run"], r["work"])], label=f"{name(r)} {what}")
    for seq, ax in axes.items():
        _finish(fig, ax, xlabel="peak VRAM (GB, torch max allocated)", ylabel="s/step (median)",
                title=f"s/step against VRAM, seq {seq}")
    return fig


def attention_figure(rows: pd.DataFrame):
    """s/step of each method/plan on math and on another attention setting in the same run (the pairs of the
    page's attention table) as bars side by side; None without a pair."""
    pairs = attention_pairs(rows)
    if pairs.empty:
        return None
    fig, (ax,) = _new_figure()
    xs = range(len(pairs))
    ax.bar([x - 0.2 for x in xs], pairs["s_per_step_median_math"], 0.4, label="math", zorder=2)
    for setting in pairs["attention_other"].unique():
        at = [i for i, a in enumerate(pairs["attention_other"]) if a == setting]
        ax.bar([x + 0.2 for x in at], pairs["s_per_step_median_other"].iloc[at], 0.4, label=str(setting), zorder=2)
    ax.set_xticks(list(xs), [f"{m}\n{label}" for m, label in zip(pairs["model_other"], pairs["label_other"])],
                  fontsize=7, rotation=30, ha="right")
    _finish(fig, ax, ylabel="s/step (median)", title="s/step on math and on the fast attention path")
    ax.legend(fontsize=8, loc="upper right")  # two entries: inside the axes, clear of the tick labels
    fig.tight_layout()
    return fig


def sweep_figures(df: pd.DataFrame) -> list[tuple[str, str, object]]:
    """(file suffix, heading, figure) of each plot the rows hold: budgets, attention settings, then each swept
    axis of numbers."""
    rows = sweep_rows(df)
    out = [("budget", "s/step against VRAM", budget_figure(rows)),
           ("attention", "s/step on math and on the fast path", attention_figure(rows))]
    out += [(suffix, title, axis_figure(rows, x, xlabel, title)) for suffix, x, title, xlabel in AXES]
    return [(s, h, f) for s, h, f in out if f is not None]
