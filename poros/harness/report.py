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
            bad = field_problems(row)
            if bad:
                raise PorosError(f"{path}:{n}: {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") +
                                 "; fix or remove that row (rows are written by poros bench)")
            records.append({**row, "plan_name": row.get("plan_name"),
                            "sweep": row.get("sweep") if isinstance(row.get("sweep"), dict) else {}})
    if not records:
        raise PorosError(f"no result rows in {', '.join(map(str, paths))}")
    return pd.DataFrame.from_records(records)


NUMBERS = ("steps", "passes", "warmup_passes", "s_per_step_median", "s_per_step_std", "peak_vram_gb",
           "parity_max_abs_diff", "bytes_h2d_per_step", "copy_gbps", "copy_hidden_share", "tokens_per_s")
SECTIONS = ("config", "provenance")  # mappings every row holds
TEXTS = ("matrix", "model", "stack", "arch")


def field_problems(row: dict) -> list[str]:
    """Fields of a row the report could not read as their kind: a number that is text, a section that is
    null or not a mapping. Each names the field, what it holds and what it should."""
    out = []
    for k in NUMBERS:
        v = row.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            out.append(f"field {k}: expected a number or null, got {v!r}")
    for k in SECTIONS:
        if not isinstance(row.get(k), dict):
            out.append(f"field {k}: expected a mapping, got {row.get(k)!r}")
    for k in TEXTS:
        if not isinstance(row.get(k), str):
            out.append(f"field {k}: expected text, got {row.get(k)!r}")
    if row.get("parity") not in (None, "PASS", "FAIL"):
        out.append(f"field parity: expected PASS, FAIL or null, got {row['parity']!r}")
    return out


def failures(df: pd.DataFrame, sweep: bool = False) -> list[str]:
    """The cells of the latest rows (of a sweep page's, with `sweep`) that FAIL (a failed run or a parity FAIL),
    as `model method` lines."""
    out = []
    for r in (sweep_rows(df) if sweep else latest(df)).to_dict("records"):
        if r["status"] == "failed" or r["parity"] == "FAIL":
            why = "parity FAIL" if r["parity"] == "FAIL" else f"failed: {str(r.get('error') or '')[:120]}"
            out.append(f"{r['model']} {r['method']}{' plan ' + r['plan_name'] if r.get('plan_name') else ''}: {why}")
    return out


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


def _point(sweep) -> str:
    return ", ".join(f"{k} {v}" for k, v in (sweep or {}).items())


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """The last row per (matrix, model, stack, method, plan, sweep point) — a re-run replaces the earlier cell."""
    df = df.copy()
    df["point"] = [_point(x) for x in df["sweep"]]
    df["plan_key"] = df["plan_name"].fillna("")
    df = df.drop_duplicates(subset=[*KEY, "plan_key", "point"], keep="last").copy()
    df["hardware"] = [_hardware(r) for r in df.to_dict("records")]
    return df


def _table(columns, rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    # A literal "|" (as in "max |diff|") would split the Markdown cell.
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows])


SPREAD = 0.10  # a timed CPU cell whose passes spread more than this share of their median is flagged
SPREAD_MARK = "†"
SPREAD_NOTE = (f"{SPREAD_MARK} passes spread more than {SPREAD:.0%} of their median (fastest to slowest): "
               "the CPU was shared or busy; compare these timings with care.")


def spread(row) -> bool:
    """Whether a timed CPU row's passes spread more than `SPREAD` of their median."""
    passes = [t for t in (row.get("per_pass_s") or []) if isinstance(t, (int, float))]
    if len(passes) < 2 or (row.get("config") or {}).get("device", "cpu") != "cpu":
        return False
    med = sorted(passes)[len(passes) // 2] if len(passes) % 2 else sum(sorted(passes)[len(passes) // 2 - 1:][:2]) / 2
    return med > 0 and (max(passes) - min(passes)) / med > SPREAD


def _s_step(row, with_std: bool = False) -> str:
    if row is None or row["status"] == "skipped":
        return DASH
    if row["status"] == "failed":
        return "FAIL"
    med, std = _num(row["s_per_step_median"]), _num(row["s_per_step_std"])
    if med is None:
        return DASH
    mark = SPREAD_MARK if spread(row) else ""
    return (f"{med:.4f}±{std:.4f}" if with_std and std is not None else f"{med:.4f}") + mark


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
    """{(model, stack, point): {method: row, "plans": {plan: poros row}}} in order of first appearance
    (later rows win); `poros` is the first plan's row."""
    cells: dict = {}
    for r in df.to_dict("records"):
        c = cells.setdefault((r["model"], r["stack"], r.get("point", "")), {"arch": r["arch"], "plans": {}})
        if r["method"] == "poros":
            c["plans"][r.get("plan_name")] = r
            c.setdefault("poros", r)
        else:
            c[r["method"]] = r
    return cells


def _baseline(c: dict):
    """The reference a poros row is compared with: resident QLoRA, else resident_gc."""
    return c.get("resident") or c.get("resident_gc")


def results_table(df: pd.DataFrame) -> str:
    """The official results table, one row per model × stack × sweep point × poros plan; columns of the
    methods the rows hold (resident_gc where plain resident is absent); on CPU without the VRAM columns."""
    present = set(df["method"])
    ref = "resident" if "resident" in present or "resident_gc" not in present else "resident_gc"
    others = [m for m in (ref, "unsloth") if m in present or m == ref]
    points = any(df.get("point", pd.Series([""])).astype(bool))
    plans = df["plan_name"].notna().any()
    columns = ["Model", "Arch", "Stack", *(["Settings"] if points else []), *(["Plan"] if plans else []),
               "Bitwise parity", "poros s/step (median±std)", *(f"{m} s/step" + (" (median±std)" if m == ref else "")
                                                               for m in others),
               *(f"{'Slowdown ' if i == 0 else ''}vs {m}" for i, m in enumerate(others)), "poros VRAM",
               *(f"{m} VRAM" for m in others), *(f"{'VRAM cut ' if i == 0 else ''}vs {m}" for i, m in enumerate(others))]
    rows = []
    for (model, stack, point), c in _cells(df).items():
        o = [c.get(m) for m in others]
        for plan, p in (c["plans"] or {None: None}).items():
            ps, pv = _ok(p, "s_per_step_median"), _ok(p, "peak_vram_gb")
            speed = [DASH if ps is None or _ok(x, "s_per_step_median") is None
                     else f"{ps / _ok(x, 's_per_step_median'):.2f}×" for x in o]
            cut = [DASH if pv is None or not _ok(x, "peak_vram_gb")
                   else f"{(1 - pv / _ok(x, 'peak_vram_gb')) * 100:.1f}%" for x in o]
            rows.append([model, c["arch"], stack, *([point or DASH] if points else []),
                         *([plan or DASH] if plans else []), _parity(p or o[0]), _s_step(p, True),
                         *(_s_step(x, i == 0) for i, x in enumerate(o)), *speed, _gb(pv),
                         *(_gb(_ok(x, "peak_vram_gb")) for x in o), *cut])
    if on_cpu(df):
        vram = 1 + 2 * len(others)
        return _table(columns[:-vram], [r[:-vram] for r in rows])
    return _table(columns, rows)


def _time_table(df: pd.DataFrame) -> str:
    rows = []
    for (model, stack, point), c in _cells(df).items():
        for plan, p in c["plans"].items():
            h2d, gbps, hidden, tps = (_ok(p, f) for f in
                                      ("bytes_h2d_per_step", "copy_gbps", "copy_hidden_share", "tokens_per_s"))
            name = ", ".join(x for x in (point, plan and f"plan {plan}") if x)
            rows.append([model + (f" ({name})" if name else ""), stack, DASH if h2d is None else f"{h2d / 1e9:.2f} GB",
                         DASH if gbps is None else f"{gbps:.1f} GB/s",
                         DASH if hidden is None else f"{hidden * 100:.1f}%", DASH if tps is None else f"{tps:.1f}"])
    columns = ["Model", "Stack", "Host→device per step", "Copy GB/s (weights)", "Copy hidden behind compute",
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
        show = lambda c: s.show(s.value(c[s.name])) if c.get(s.name) is not None else s.show(s.default)  # noqa: E731
        if not s.report_default and all(show(c) == s.show(s.default) for c in configs):
            continue
        if s.kind == COMPUTED:  # a method that ran with its own value (a matrix's method_settings) is named
            by_method: dict = {}
            for c, m in zip(df["config"], df["method"]):
                by_method.setdefault(m, []).append(show(c))
            values = {m: _uniq(v, "; ") for m, v in by_method.items()}
            if len(set(values.values())) > 1 and all("; " not in v for v in values.values()):
                methods: dict = {}
                for m, v in values.items():
                    methods.setdefault(v, []).append(m)
                out.append((s.label, "; ".join(f"{v} ({', '.join(ms)})" for v, ms in methods.items())))
                continue
        out.append((s.label if s.kind == COMPUTED else f"{s.label} (poros)", _uniq(map(show, configs), "; ")))
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
        measured = [c for (model, stack, _), c in cells.items() if model.lower() == str(r["model"]).lower()]
        if not measured:
            continue
        # Compare like with like where the reference stack was measured; otherwise the first measured stack.
        c = next((c for (m, s, _), c in cells.items() if m.lower() == r["model"].lower() and s == r["stack"]),
                 measured[0])
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
        if any(spread(r) for r in g.to_dict("records") if r["status"] == "ok"):
            parts.append(SPREAD_NOTE)
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


# A sweep page (`poros report --sweep`): every measured row of one or more sweeps, each compared only with the
# reference of its own run on its own GPU, and a plot per swept axis.

SWEEP_COLUMNS = ("Model", "GPUs", "GPU", "Seq", "Attention", "Grad-accum", "Method / plan", "Schedule",
                 "Parity (gate)", "s/step", "vs resident", "Tokens/s", "Peak VRAM", "Peak reserved", "Predicted peak",
                 "Host→device per step", "Copy hidden", "Resident layers", "Block")
SCALING_COLUMNS = ("Model", "Method / plan", "Seq", "Grad-accum", "GPU", "GPUs", "Tokens/s", "Tokens/s on 1 GPU",
                   "Speed-up", "Per-GPU efficiency")
ATTENTION_COLUMNS = ("Model", "Method / plan", "Seq", "GPU", "Attention", "s/step", "s/step on math", "vs math",
                     "Tokens/s", "Tokens/s on math", "Peak VRAM", "Peak VRAM on math")
REFERENCES = ("resident", "resident_gc")  # the gate's reference; plain resident preferred as the baseline
TASK = ("model", "stack", "seq_len", "grad_accum", "attention", "loss_chunk")  # what a row computes, but its GPUs
SWEEP_INTRO = (
    "Each poros plan first passed the parity gate against the reference's states recorded in the same run "
    "(torch.equal on every loss, LoRA gradient, weight and AdamW tensor), then was timed after discarded warm-up. "
    "`vs resident` divides by the s/step of the reference (resident QLoRA, else resident_gc) of the same work "
    "(model, sequence length, attention, gradient accumulation, number of GPUs) in the same run on the same GPU; "
    "the GPU column names a run's (first) GPU by its UUID's first 8 hex digits. Unsloth is timed on the same store "
    "but not gated (its arithmetic differs); a control row gates the reference against its own recorded states. "
    "Peak VRAM is torch's allocated peak, Peak reserved its reserved one (CUDA graphs keep their intermediates in "
    "private pools, reserved but not allocated; rows from before it was recorded show —), Predicted peak the "
    "planner's. Under data parallelism (GPUs > 1) every rank trains its own data: tokens/s counts every rank's "
    "tokens, the peak is the largest rank's.")


def schedule(config: dict) -> str:
    """How a poros row scheduled its work, in words (from its settings)."""
    budget = config.get("vram_budget")
    parts = ["every layer streamed" if budget is None else
             f"budget {budget / 1e9:g} GB" if isinstance(budget, (int, float)) else f"budget {budget}"]
    parts += [*schedule_kind(config)]
    return ", ".join(parts)


def schedule_kind(config: dict) -> list[str]:
    """A poros row's schedule but for its budget: plans of one kind differ in their budget only."""
    parts = []
    if config.get("placement") == "spread":
        parts.append("spread")
    if config.get("offload_inputs"):
        parts.append("inputs in host memory")
    if config.get("overlap_backward") is False:
        parts.append("serial backward")
    if config.get("accumulation") not in (None, "layer"):
        parts.append(f"{config['accumulation']}-major accumulation")
    if config.get("keep_activations"):
        kept = config.get("kept_layers")
        parts.append("activations kept" + ("" if kept is None else f" ({kept} layers)"))
    if config.get("cuda_graphs"):
        parts.append("CUDA graphs")
    return parts


def _sweep_row(r: dict) -> dict:
    """A row with the columns a sweep page groups by: what it computed, where and in which run it ran."""
    c, p = r["config"], r["provenance"]
    gpus = p.get("gpus") or []
    uuid = gpus[0]["uuid"] if gpus else "cpu"
    poros, control = r["method"] == "poros", r.get("control") is True  # a column other rows lack reads NaN
    out = {**r, **{k: c.get(k) for k in TASK[2:]}, "grad_accum": c.get("grad_accum") or 1,
           "gpus": int(r.get("world_size") or c.get("gpus") or 1), "gpu": uuid,
           "gpu_label": uuid.removeprefix("GPU-")[:8], "host": p.get("host"), "control": control,
           "label": " ".join(x for x in (r["method"], poros and _text(r.get("plan_name")), control and "(control)")
                             if x),
           "schedule": schedule(c) if poros else DASH, "point": _point(r["sweep"]),
           "timed_ok": r["status"] == "ok" and not control and _num(r["s_per_step_median"]) is not None}
    # a run: one matrix (or sweep) on one machine and GPU; rows that name their run keep apart runs of one matrix
    out["run"] = " ".join(str(x) for x in (r["matrix"], out["host"], uuid, _text(r.get("run")) or ""))
    out["task"] = " | ".join(str(out[k]) for k in TASK)
    out["work"] = f"{out['task']} | {out['gpus']}"
    return out


def sweep_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of a sweep page, in order; a row repeating a cell of its run (work, method, plan, sweep point,
    control or not) replaces the earlier one."""
    rows = pd.DataFrame.from_records([_sweep_row(r) for r in df.to_dict("records")])
    rows["plan_key"] = rows["plan_name"].fillna("")
    keys = ["run", "work", "method", "plan_key", "point", "control"]
    return rows.drop_duplicates(subset=keys, keep="last").reset_index(drop=True)


def baselines(rows: pd.DataFrame) -> pd.Series:
    """s/step of the reference per (run, work): plain resident over resident_gc."""
    ref = rows[rows["method"].isin(REFERENCES) & rows["timed_ok"]]
    ref = ref.assign(preference=ref["method"].map(REFERENCES.index)).sort_values("preference", kind="stable")
    return ref.groupby(["run", "work"])["s_per_step_median"].first()


def _steps(n) -> str:
    return DASH if _num(n) is None else f"{int(n)} step" if int(n) == 1 else f"{int(n)} steps"


def _sweep_parity(r: dict) -> str:
    gate = f"vs {r['gate']}" + (f", gated under {int(r['alone_of'])} ranks" if _num(r.get("alone_of")) else "")
    verdict = None if _text(r["parity"]) is None else f"{r['parity']} ({_steps(r.get('parity_steps'))}, {gate})"
    if r["status"] != "ok":
        reason = str(r.get("error") or r["status"]).split(":", 1)[-1].strip().replace("\n", " ")
        return f"{verdict}; not timed: {reason}" if verdict else f"not run: {reason}"
    if r["control"]:
        return f"{r['parity']} (control: reference vs itself, {_steps(r.get('parity_steps'))})"
    if r["method"] == "unsloth":
        return "not gated (other arithmetic)"
    return verdict or DASH


def _fmt(v, fmt: str) -> str:
    return DASH if _num(v) is None else fmt.format(_num(v))


def _scaled(v, by: float, fmt: str) -> str:
    return DASH if _num(v) is None else fmt.format(_num(v) * by)


def sweep_table(rows: pd.DataFrame) -> str:
    """Every row of the page; ratios against the reference of the same run, work and GPU."""
    base = baselines(rows)
    out = []
    for r in rows.to_dict("records"):
        head = [r["model"], str(r["gpus"]), r["gpu_label"], _fmt(r["seq_len"], "{:.0f}"), str(r["attention"]),
                str(r["grad_accum"]), r["label"], r["schedule"], _sweep_parity(r)]
        if not r["timed_ok"]:
            out.append(head + [DASH] * (len(SWEEP_COLUMNS) - len(head)))
            continue
        s, ref = r["s_per_step_median"], base.get((r["run"], r["work"]))
        plan = r.get("plan") if isinstance(r.get("plan"), dict) else {}
        out.append(head + [f"{s:.4f}", DASH if ref is None else f"{s / ref:.2f}×", _fmt(r["tokens_per_s"], "{:.0f}"),
                           _gb(_num(r["peak_vram_gb"])), _gb(_num(r.get("peak_reserved_gb"))),
                           _gb(_num(r.get("predicted_peak_vram_gb"))), _scaled(r["bytes_h2d_per_step"], 1e-9, "{:.2f} GB"),
                           _scaled(r["copy_hidden_share"], 100, "{:.0f}%"),
                           _fmt(r.get("resident_layers"), "{:.0f}"), _fmt(plan.get("block_size"), "{:.0f}")])
    return _table(SWEEP_COLUMNS, out)


def scaling_pairs(rows: pd.DataFrame) -> pd.DataFrame:
    """Each data-parallel row beside the latest one-GPU row of the same task and method/plan on a GPU of the
    same machine (columns `_many`, `_one`)."""
    timed = rows[rows["timed_ok"] & rows["tokens_per_s"].notna()].reset_index()
    many, one = timed[timed["gpus"] > 1], timed[timed["gpus"] == 1]
    pairs = many.merge(one, on=["task", "label", "host"], suffixes=("_many", "_one"))
    same = [o in {g["uuid"] for g in (p.get("gpus") or [])} or (o == "cpu" and not p.get("gpus"))
            for o, p in zip(pairs["gpu_one"], pairs["provenance_many"])]
    return pairs[same].drop_duplicates(subset="index_many", keep="last")


def scaling_table(rows: pd.DataFrame) -> str | None:
    """Tokens/s of each data-parallel row against the same plan on one GPU; None when there is no pair."""
    out = []
    for p in scaling_pairs(rows).to_dict("records"):
        ratio, world = p["tokens_per_s_many"] / p["tokens_per_s_one"], p["gpus_many"]
        gpus = p["provenance_many"].get("gpus") or []
        out.append([p["model_many"], p["label"], _fmt(p["seq_len_many"], "{:.0f}"), str(p["grad_accum_many"]),
                    gpus[0]["name"] if gpus else "cpu", str(world), f"{p['tokens_per_s_many']:.0f}",
                    f"{p['tokens_per_s_one']:.0f}", f"{ratio:.2f}×", f"{ratio / world * 100:.0f}%"])
    return _table(SCALING_COLUMNS, out) if out else None


def attention_pairs(rows: pd.DataFrame) -> pd.DataFrame:
    """Each timed row of another attention setting beside the latest math row of the same run, method/plan and
    work but for attention (columns `_other`, `_math`)."""
    timed = rows[rows["timed_ok"]].reset_index()
    timed = timed.assign(same=[" | ".join(str(r[k]) for k in ("run", "model", "stack", "seq_len", "grad_accum",
                                                              "loss_chunk", "gpus", "label"))
                               for r in timed.to_dict("records")])
    other, math_ = timed[timed["attention"] != "math"], timed[timed["attention"] == "math"]
    pairs = other.merge(math_, on="same", suffixes=("_other", "_math"))
    return pairs.drop_duplicates(subset="index_other", keep="last")


def attention_table(rows: pd.DataFrame) -> str | None:
    out = [[p["model_other"], p["label_other"], _fmt(p["seq_len_other"], "{:.0f}"), p["gpu_label_other"],
            str(p["attention_other"]), f"{p['s_per_step_median_other']:.4f}", f"{p['s_per_step_median_math']:.4f}",
            f"{p['s_per_step_median_other'] / p['s_per_step_median_math']:.2f}×",
            _fmt(p["tokens_per_s_other"], "{:.0f}"), _fmt(p["tokens_per_s_math"], "{:.0f}"),
            _gb(_num(p["peak_vram_gb_other"])), _gb(_num(p["peak_vram_gb_math"]))]
           for p in attention_pairs(rows).to_dict("records")]
    return _table(ATTENTION_COLUMNS, out) if out else None


def backends_table(rows: pd.DataFrame) -> str | None:
    """Which SDPA backend ran for which attention shape, per model and attention setting, and for which methods."""
    seen: dict[tuple, set] = {}
    for r in rows.to_dict("records"):
        for shape, backend in (r.get("attention_backends") or {}).items():
            seen.setdefault((r["model"], str(r["attention"]), shape, backend), set()).add(r["method"])
    if not seen:
        return None
    return _table(("Model", "Attention setting", "Layer shape", "Backend", "Methods"),
                  [[*k, ", ".join(sorted(ms))] for k, ms in seen.items()])


def render_sweep_markdown(df: pd.DataFrame, title: str | None = None, plots=()) -> str:
    """The sweep page: every row, data-parallel scaling, math against the fast path, the attention backends,
    provenance, then the plots (heading, PNG name) it links."""
    rows = sweep_rows(df)
    parts = [f"# {title or 'Poros — plans measured'}", SWEEP_INTRO, sweep_table(rows)]
    sections = (("Data-parallel scaling", "Tokens/s under data parallelism against the same plan on one GPU of the "
                 "same machine; per-GPU efficiency is the speed-up divided by the number of GPUs.", scaling_table),
                ("Attention: math against the fast path", "Each method or plan on another attention setting "
                 "against the same run on math (same store, same GPU); `vs math` divides the s/step.",
                 attention_table),
                ("Attention backends", "The SDPA backend each attention shape ran on, as recorded on the first "
                 "step of each timed row.", backends_table))
    for heading, text, make in sections:
        table = make(rows)
        if table:
            parts += [f"## {heading}\n\n{text}", table]
    parts.append(_provenance_line(df))
    parts += [f"## {heading}\n\n![{heading}]({png})" for heading, png in plots]
    return "\n\n".join(parts) + "\n"


# The sweep page's plots: one per swept axis with a line of two points or more.
# (axis, column, heading, x label, y column, y label)
AXES = (("seq", "seq_len", "Tokens/s against sequence length", "sequence length (tokens)"),
        ("accum", "grad_accum", "Tokens/s against gradient accumulation", "gradient accumulation (micro-batches per step)"),
        ("gpus", "gpus", "Tokens/s against GPUs", "GPUs (data-parallel ranks)"))
LINE_CONTEXT = ("seq_len", "grad_accum", "attention", "gpus", "stack")  # what else a line of one axis holds fixed
LINE_LABELS = {"seq_len": "seq {}", "grad_accum": "grad-accum {}", "attention": "{} attention", "gpus": "{} GPUs",
               "stack": "{}"}
MARKS = {"resident": ("*", "resident QLoRA"), "resident_gc": ("P", "resident_gc"), "unsloth": ("D", "unsloth")}


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
    timed = timed.assign(hardware=[_hardware(r) for r in timed.to_dict("records")])
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
    poros = timed[timed["method"] == "poros"]
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
            fig.savefig(png, dpi=120)
            links.append((heading, png.name))
        out_md.write_text(render_sweep_markdown(df, title, links))
        return out_md
    reference = load_reference(reference_csv) if reference_csv is not None else None
    out_md.parent.mkdir(parents=True, exist_ok=True)
    png = plot(df, out_md.with_suffix(".png"))
    text = render_markdown(df, reference, title)
    shows = plot_title(df)
    out_md.write_text(text + f"\n## {shows}\n\n![{shows}]({png.name})\n")
    return out_md
