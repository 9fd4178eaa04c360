"""Validation reports: Markdown tables and a PNG rendered purely from saved results (JSON Lines)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pandas as pd

from poros.errors import PorosError
from poros.settings import COMPUTED, SCHEDULE, SETTINGS

KEY = ("matrix", "model", "stack", "method")
REQUIRED = KEY + (
    "arch", "status", "steps", "passes", "warmup_passes", "reduced", "s_per_step_median", "s_per_step_std",
    "peak_vram_gb", "parity", "parity_max_abs_diff", "bytes_h2d_per_step", "copy_gbps", "copy_hidden_share",
    "tokens_per_s", "config", "provenance",
)
METHODS = {"poros": "poros (blockwise residency)", "resident": "resident (full QLoRA)",
           "resident_gc": "resident + gradient checkpointing", "unsloth": "unsloth"}
STATUSES = ("ok", "failed", "skipped")
RESULTS_COLUMNS = (
    "Model", "Arch", "Stack", "Bitwise parity", "poros s/step (median±std)", "resident s/step (median±std)",
    "unsloth s/step", "Slowdown vs resident", "vs unsloth", "poros VRAM", "resident VRAM", "unsloth VRAM",
    "VRAM cut vs resident", "vs unsloth",
)
VRAM_COLUMNS = 5  # the last five results columns; without a device memory (CPU) they mean nothing
REFERENCE_COLUMNS = (
    "hardware", "model", "arch", "stack", "parity", "poros_s_step_median", "poros_s_step_std", "resident_s_step",
    "unsloth_s_step", "poros_vram_gb", "resident_vram_gb", "unsloth_vram_gb",
)
DASH = "—"
# The official validation figures, shipped with the source tree (reports/reference/README.md).
OFFICIAL_REFERENCE = Path(__file__).resolve().parents[2] / "reports" / "reference" / "official.csv"


def load_results(paths) -> pd.DataFrame:
    """Read results files (JSON Lines), in order, into one row per line.

    Raises:
        PorosError: naming the file (and line) of a missing, binary or non-UTF-8 file, malformed JSON
            or a row missing keys.
    """
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(x) for x in paths]
    records = []
    for path in paths:
        if path.is_dir():
            raise PorosError(f"{path} is a folder, expected a results file, e.g. {path / 'results.jsonl'}")
        if not path.is_file():
            raise PorosError(f"{path}: no such results file")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise PorosError(f"{path}: not a results file (byte {e.start} is not UTF-8 text; expected the JSON "
                             f"Lines a poros bench run writes, e.g. OUT/results.jsonl)") from None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PorosError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise PorosError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in REQUIRED if k not in row]
            if missing:
                raise PorosError(f"{path}:{n}: missing key(s) {', '.join(missing)}")
            if row["method"] not in METHODS or row["status"] not in STATUSES:
                raise PorosError(f"{path}:{n}: method must be one of {', '.join(METHODS)} and status one of "
                                 f"{', '.join(STATUSES)}, got {row['method']!r} / {row['status']!r}")
            records.append(row)
    if not records:
        raise PorosError(f"no result rows in {', '.join(map(str, paths))}")
    return pd.DataFrame.from_records(records)


def load_reference(csv_path=OFFICIAL_REFERENCE) -> pd.DataFrame:
    """Read reference figures in the format of `reports/reference/official.csv` (empty fields become NaN).

    Lines starting with `#` before the header are comments; one reading `# Source: TEXT` names where
    the figures come from, kept as `ref.attrs["source"]` and printed in the report.

    Raises:
        PorosError: naming the file when it is missing or lacks a column.
    """
    path = Path(csv_path)
    if not path.is_file():
        hint = (" (the official figures ship in a source checkout: install with pip install -e . or pass "
                "--reference FILE.csv)" if path == OFFICIAL_REFERENCE else "")
        raise PorosError(f"{path}: no such reference file{hint}")
    lines = path.read_text().splitlines(keepends=True)
    comments = []
    while lines and lines[0].startswith("#"):
        comments.append(lines.pop(0)[1:].strip())
    ref = pd.read_csv(io.StringIO("".join(lines)), dtype={"hardware": str, "model": str, "stack": str, "parity": str})
    missing = [c for c in REFERENCE_COLUMNS if c not in ref.columns]
    if missing:
        raise PorosError(f"{path}: missing column(s) {', '.join(missing)}")
    source = [c.removeprefix("Source:").strip() for c in comments if c.startswith("Source:")]
    if source:
        ref.attrs["source"] = source[0]
    return ref


def _num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _text(v) -> str | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) or v == "" else str(v)


def _uniq(values, sep: str = ", ") -> str:
    out = list(dict.fromkeys(str(v) for v in values if _text(v) is not None))
    return sep.join(out) if out else DASH


def _hardware(row) -> str:
    gpus = row["provenance"].get("gpus") or []
    return row["config"].get("hardware") or (gpus[0]["name"] if gpus else "CPU")


def on_cpu(df: pd.DataFrame) -> bool:
    """Whether every row ran on the CPU, where device memory, host→device copies and CUDA mean nothing."""
    return all((c.get("device") or ("cuda" if p.get("gpus") else "cpu")) == "cpu"
               for c, p in zip(df["config"], df["provenance"]))


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """The last row per (matrix, model, stack, method) — a re-run replaces the earlier cell."""
    df = df.drop_duplicates(subset=list(KEY), keep="last").copy()
    df["hardware"] = [_hardware(r) for r in df.to_dict("records")]
    return df


def _table(columns, rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    # A literal "|" (as in "max |diff|") would split the Markdown cell.
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows])


def _s_step(row, with_std: bool = False) -> str:
    if row is None or row["status"] == "skipped":
        return DASH
    if row["status"] == "failed":
        return "FAIL"
    med, std = _num(row["s_per_step_median"]), _num(row["s_per_step_std"])
    if med is None:
        return DASH
    return f"{med:.4f}±{std:.4f}" if with_std and std is not None else f"{med:.4f}"


def _ok(row, field: str) -> float | None:
    return _num(row[field]) if row is not None and row["status"] == "ok" else None


def _gb(v: float | None) -> str:
    return DASH if v is None else f"{v:.2f} GB"


def _parity(row) -> str:
    if row is None or _text(row["parity"]) is None:
        return DASH
    diff = _num(row["parity_max_abs_diff"])
    gate = _text(row.get("gate"))
    against = "" if gate in (None, "resident") else f" vs {gate}"  # rows say which reference the gate ran
    if row["parity"] == "PASS":
        return f"PASS{against}" if diff is None else f"PASS{against} ({diff:.2e})"
    return f"FAIL{against}" if diff is None else f"FAIL{against} (max |diff| {diff:.2e})"


def _cells(df: pd.DataFrame) -> dict:
    """{(model, stack): {method: row}} in order of first appearance (later rows win)."""
    cells: dict = {}
    for r in df.to_dict("records"):
        cells.setdefault((r["model"], r["stack"]), {"arch": r["arch"]})[r["method"]] = r
    return cells


def results_table(df: pd.DataFrame) -> str:
    """The official results table, one row per model × stack; on CPU without the VRAM columns."""
    rows = []
    for (model, stack), c in _cells(df).items():
        p, r, u = c.get("poros"), c.get("resident"), c.get("unsloth")
        ps, pv = _ok(p, "s_per_step_median"), _ok(p, "peak_vram_gb")
        speed = [DASH if ps is None or _ok(o, "s_per_step_median") is None
                 else f"{ps / _ok(o, 's_per_step_median'):.2f}×" for o in (r, u)]
        cut = [DASH if pv is None or not _ok(o, "peak_vram_gb")
               else f"{(1 - pv / _ok(o, 'peak_vram_gb')) * 100:.1f}%" for o in (r, u)]
        rows.append([model, c["arch"], stack, _parity(p or r), _s_step(p, True), _s_step(r, True), _s_step(u),
                     *speed, *(_gb(_ok(x, "peak_vram_gb")) for x in (p, r, u)), *cut])
    if on_cpu(df):
        return _table(RESULTS_COLUMNS[:-VRAM_COLUMNS], [r[:-VRAM_COLUMNS] for r in rows])
    return _table(RESULTS_COLUMNS, rows)


def _time_table(df: pd.DataFrame) -> str:
    rows = []
    for (model, stack), c in _cells(df).items():
        if "poros" not in c:
            continue
        h2d, gbps, hidden, tps = (_ok(c["poros"], f) for f in
                                  ("bytes_h2d_per_step", "copy_gbps", "copy_hidden_share", "tokens_per_s"))
        row = [model, stack, DASH if h2d is None else f"{h2d / 1e9:.2f} GB",
               DASH if gbps is None else f"{gbps:.1f} GB/s",
               DASH if hidden is None else f"{hidden * 100:.1f}%", DASH if tps is None else f"{tps:.1f}"]
        rows.append(row)
    columns = ["Model", "Stack", "Host→device per step (weights)", "Copy GB/s", "Copy hidden behind compute",
               "Tokens/s"]
    return _table(columns, rows)


def _runs(df: pd.DataFrame) -> str:
    return _uniq(f"{s} steps × {p} passes" for s, p in zip(df["steps"], df["passes"]))


def _setting_rows(df: pd.DataFrame) -> list[tuple[str, str]]:
    """A row per training setting (poros/settings.py): what is computed over every row, how poros
    schedules it over the poros rows (distinct values joined by "; "); a setting a row predates reads
    as its default."""

    out = []
    poros = [c for c, m in zip(df["config"], df["method"]) if m == "poros"]
    cpu = on_cpu(df)
    for s in SETTINGS:
        if s.kind not in (COMPUTED, SCHEDULE) or (cpu and s.gpu_only):
            continue
        configs = list(df["config"]) if s.kind == COMPUTED else poros
        if not configs:
            continue
        shown = [s.show(s.value(c[s.name])) if c.get(s.name) is not None else s.show(s.default) for c in configs]
        if s.quiet and set(shown) == {s.show(s.default)}:
            continue
        out.append((s.label if s.kind == COMPUTED else f"{s.label} (poros)", _uniq(shown, "; ")))
    return out


def _config_table(df: pd.DataFrame, hw: str) -> str:
    cfg = lambda k: [c.get(k) for c in df["config"]]  # noqa: E731
    prov = list(df["provenance"])
    mem = _uniq(g.get("memory_gb") for p in prov for g in p.get("gpus") or [] if g.get("name") == hw)
    methods = [m for m in METHODS if m in set(df["method"])]
    bnb = _uniq(p.get("versions", {}).get("bitsandbytes") for p in prov)
    rows = [
        ("Hardware", hw + ("" if mem == DASH else f" ({mem} GB VRAM)")),
        ("Precision", _uniq(cfg("precision")).upper()),
        ("Steps × passes", f"{_runs(df)} (warm-up discarded; median ± std across passes)"),
        *_setting_rows(df),
        ("Dataset", _uniq(f"`{d}`" for d in cfg("dataset") if d)),
        ("Methods", ", ".join(METHODS[m] for m in methods)),
        ("Software stacks", _uniq(df["stack"], " and ") + ("" if bnb == DASH else f", bitsandbytes {bnb}")),
    ]
    return _table(("Field", "Value"), rows)


def _provenance_line(df: pd.DataFrame) -> str:
    prov = list(df["provenance"])
    ver = lambda k: _uniq(p.get("versions", {}).get(k) for p in prov)  # noqa: E731
    git = _uniq(f"{g.get('commit') or 'unknown'}{' (dirty)' if g.get('dirty') else ''}"
                for g in (p.get("git") or {} for p in prov))
    gpus = _uniq(f"{g.get('name')} (UUID {g.get('uuid')}, driver {g.get('driver')})"
                 for p in prov for g in p.get("gpus") or [])
    times = sorted(t for t in (p.get("time") for p in prov) if t)
    span = f"{times[0]} → {times[-1]}" if times else DASH
    cuda = "" if on_cpu(df) else f"CUDA {_uniq(p.get('cuda') for p in prov)}, "
    gpu = "" if on_cpu(df) else f"GPU {gpus}; "
    return (f"Provenance: poros {ver('poros')} at commit {git}; torch {_uniq(p.get('torch') for p in prov)}, "
            f"{cuda}transformers {ver('transformers')}, bitsandbytes {ver('bitsandbytes')}, peft {ver('peft')}; "
            f"{gpu}host {_uniq(p.get('host') for p in prov)}; rows recorded {span}.")


def _reference_table(df: pd.DataFrame, ref: pd.DataFrame) -> str:
    cells, rows = _cells(df), []
    for r in ref.to_dict("records"):
        measured = [c for (model, stack), c in cells.items() if model.lower() == str(r["model"]).lower()]
        if not measured:
            continue
        # Compare like with like where the reference stack was measured; otherwise the first measured stack.
        c = next((c for (m, s), c in cells.items() if m.lower() == r["model"].lower() and s == r["stack"]), measured[0])
        med, std = _num(r["poros_s_step_median"]), _num(r["poros_s_step_std"])
        ref_poros = DASH if med is None else (f"{med:.4f}" if std is None else f"{med:.4f}±{std:.4f}")
        ref_res = _num(r["resident_s_step"])
        rows.append([r["model"], _text(r["hardware"]) or DASH, _text(r["stack"]) or DASH,
                     ref_poros, _s_step(c.get("poros"), True),
                     DASH if ref_res is None else f"{ref_res:.4f}", _s_step(c.get("resident"), True),
                     _gb(_num(r["poros_vram_gb"])), _gb(_ok(c.get("poros"), "peak_vram_gb")),
                     _gb(_num(r["resident_vram_gb"])), _gb(_ok(c.get("resident"), "peak_vram_gb"))])
    cols = ("Model", "Reference hardware", "Reference stack", "ref poros s/step", "measured poros s/step",
            "ref resident s/step", "measured resident s/step", "ref poros VRAM", "measured poros VRAM",
            "ref resident VRAM", "measured resident VRAM")
    if not rows:
        return "No model is present in both the reference and the results."
    source = f"Reference figures: {ref.attrs['source']}. " if ref.attrs.get("source") else ""
    return _table(cols, rows) + (f"\n\n{source}Measured cells are on the reference row's stack where that stack "
                                 "was measured, otherwise on the first stack measured for the model.")


def render_markdown(df: pd.DataFrame, reference: pd.DataFrame | None = None, title: str | None = None) -> str:
    """The full report: per hardware a configuration, results, time breakdown and provenance."""
    df, parts = latest(df), []
    for hw, g in df.groupby("hardware", sort=False):
        parts += [f"# {title or 'Poros — Validation Results'} ({hw})", "## Configuration", _config_table(g, hw)]
        reduced = g[g["reduced"].astype(bool)]
        if len(reduced):
            parts.append(f"> **Reduced run: {_runs(reduced)} (the matrix file asks for more) — "
                         "not comparable to full runs.**")
        parts += [f"## Results — {hw}", results_table(g)]
        if not on_cpu(g):  # no host→device copy to account for on the CPU
            parts += ["## Where the time goes (poros)", _time_table(g)]
        if reference is not None:
            parts += ["## Reference vs measured", _reference_table(g, reference)]
        parts.append(_provenance_line(g))
    return "\n\n".join(parts) + "\n"


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
    colours = dict(zip(METHODS, ("tab:blue", "tab:orange", "tab:red", "tab:green")))
    if title == "s/step vs peak VRAM":
        ok = measured[measured["peak_vram_gb"].notna()]
        for method, colour in colours.items():
            pts = ok[ok["method"] == method]
            if len(pts):
                ax.scatter(pts["peak_vram_gb"], pts["s_per_step_median"], color=colour, label=method, zorder=2)
            for r in pts.to_dict("records"):
                ax.annotate(_label(r, many_stacks, many_hw), (r["peak_vram_gb"], r["s_per_step_median"]),
                            fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.set(xlabel="peak VRAM (GB, torch max allocated)")
        ax.margins(x=0.2, y=0.1)  # room for the point labels
    else:
        groups = list(dict.fromkeys((r["model"], r["stack"], r["hardware"]) for r in measured.to_dict("records")))
        methods = [m for m in METHODS if m in set(measured["method"])]
        width = 0.8 / max(len(methods), 1)
        for i, method in enumerate(methods):
            rows = {(r["model"], r["stack"], r["hardware"]): r
                    for r in measured[measured["method"] == method].to_dict("records")}
            xs = [n for n, g in enumerate(groups) if g in rows]
            ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in xs],
                   [rows[groups[x]]["s_per_step_median"] for x in xs], width,
                   yerr=[_num(rows[groups[x]]["s_per_step_std"]) or 0.0 for x in xs], capsize=3,
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
    png_path = Path(png_path)
    figure(df).savefig(png_path, dpi=120)
    return png_path


def write_report(results_paths, out_md, reference_csv=None, title: str | None = None) -> Path:
    """Write the Markdown report and, beside it, the PNG it embeds (same stem, `.png`)."""
    df = load_results(results_paths)
    reference = load_reference(reference_csv) if reference_csv is not None else None
    out_md = Path(out_md)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    png = plot(df, out_md.with_suffix(".png"))
    text = render_markdown(df, reference, title)
    shows = plot_title(df)
    out_md.write_text(text + f"\n## {shows}\n\n![{shows}]({png.name})\n")
    return out_md
