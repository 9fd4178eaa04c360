"""The tables of a matrix page: configuration, results per model and method, where poros's time goes,
reference against measured figures, and the provenance line."""

from __future__ import annotations

import pandas as pd

from poros.engine.method_info import NAMES, PLANNED, REFERENCES, UNGATED, by_value, is_planned
from poros.harness.report.floor import FLOOR_COLUMNS, FLOOR_NOTE, floor_cells, probed
from poros.harness.report.format import DASH, fmt_gb, md_table, num, steps_by_passes, text_or_none, uniq
from poros.harness.report.rows import named, on_cpu, planned_shown, row_gpus, setting_shown
from poros.harness.stacks import same_stack
from poros.provenance import is_hardware
from poros.settings import COMPUTED, SCHEDULE, SETTINGS

SPREAD = 0.10  # a timed CPU cell whose passes spread more than this share of their median is flagged
SPREAD_MARK = "†"


def _spread_share(row) -> float | None:
    """How far a timed CPU row's passes spread, fastest to slowest, as a share of their median (None: not a CPU
    row, or fewer than two passes)."""
    passes = [t for t in (row.get("per_pass_s") or []) if isinstance(t, (int, float))]
    if len(passes) < 2 or (row.get("config") or {}).get("device", "cpu") != "cpu":
        return None
    med = sorted(passes)[len(passes) // 2] if len(passes) % 2 else sum(sorted(passes)[len(passes) // 2 - 1:][:2]) / 2
    return (max(passes) - min(passes)) / med if med > 0 else None


def spread(row) -> bool:
    """Whether a timed CPU row's passes spread more than `SPREAD` of their median."""
    share = _spread_share(row)
    return share is not None and share > SPREAD


def overloaded(row) -> bool:
    """Whether a timed CPU row's passes ended with the host's load average above the CPUs its process could use:
    other work shared them (rows from before the load was recorded: not known, so not flagged)."""
    load, cores = num(row.get("load_avg_max")), num(row.get("cores"))
    cpu = (row.get("config") or {}).get("device", "cpu") == "cpu"
    return cpu and load is not None and cores is not None and load > cores


def untrusted(row) -> str | None:
    """Why a timed row's seconds say more about a busy machine than about the method (None: nothing says so)."""
    why = []
    if spread(row):
        why.append(f"its passes spread {_spread_share(row):.0%} of their median")
    if overloaded(row):
        why.append(f"the load average reached {num(row['load_avg_max']):.1f} on {int(num(row['cores']))} CPUs")
    return " and ".join(why) or None


def timing_warning(df: pd.DataFrame) -> str | None:
    """The line a results table stands under where any of its timed rows cannot be trusted (`untrusted`), naming
    each and why, so a reader sees it before the figures; None where every row's timing holds."""
    named_rows = [(r, untrusted(r)) for r in df.to_dict("records") if r["status"] == "ok"]
    flagged = [f"{named(r['model'], r.get('point'), r.get('plan_name'))} {r['method']} ({why})"
               for r, why in named_rows if why]
    if not flagged:
        return None
    return (f"> **These timings cannot be trusted:** the CPU was shared or busy while {len(flagged)} of the cells "
            f"below ran — {'; '.join(flagged)}. Their s/step and ratios say more about the machine than about the "
            f"methods (marked {SPREAD_MARK} where the passes spread over {SPREAD:.0%}); rerun on an idle machine "
            f"for figures to quote.")


def _s_step(row, with_std: bool = False) -> str:
    if row is None or row["status"] == "skipped":
        return DASH
    if row["status"] == "failed":
        return "FAIL"
    med, std = num(row["s_per_step_median"]), num(row["s_per_step_std"])
    if med is None:
        return DASH
    mark = SPREAD_MARK if spread(row) else ""
    return (f"{med:.4f}±{std:.4f}" if with_std and std is not None else f"{med:.4f}") + mark


def _ok(row, field: str) -> float | None:
    return num(row[field]) if row is not None and row["status"] == "ok" else None


def _parity(row) -> str:
    if row is None or text_or_none(row["parity"]) is None:
        return DASH
    diff = num(row["parity_max_abs_diff"])
    gate = text_or_none(row.get("gate"))
    against = "" if gate in (None, REFERENCES[0]) else f" vs {gate}"  # rows say which reference the gate ran
    if row["parity"] == "PASS":
        return f"PASS{against}" if diff is None else f"PASS{against} ({diff:.2e})"
    return f"FAIL{against}" if diff is None else f"FAIL{against} (max |diff| {diff:.2e})"


def _cells(df: pd.DataFrame) -> dict:
    """{(model, stack, point): {method: row, "plans": {plan: poros row}}} in order of first appearance
    (later rows win); the planned method's (poros's) entry is its first plan's row."""
    cells: dict = {}
    for r in df.to_dict("records"):
        c = cells.setdefault((r["model"], r["stack"], r.get("point", "")), {"arch": r["arch"], "plans": {}})
        if is_planned(r["method"]):
            c["plans"][r.get("plan_name")] = r
            c.setdefault(r["method"], r)
        else:
            c[r["method"]] = r
    return cells


APART = " †"
APART_NOTE = ("† The two rows of this ratio ran on different GPUs (their UUIDs differ, or one row's passes ran on "
              "more than one): it compares machines as well "
              "as methods, and GPUs of one model differ in speed. Measure both methods on one GPU to compare them.")


def results_table(df: pd.DataFrame) -> str:
    """The official results table, one row per model × stack × sweep point × poros plan; columns of the
    methods the rows hold (resident_gc where plain resident is absent); on CPU without the VRAM columns."""
    present = set(df["method"])
    ref = next((m for m in REFERENCES if m in present), REFERENCES[0])
    others = [ref, *(m for m in UNGATED if m in present)]
    points = any(df.get("point", pd.Series([""])).astype(bool))
    plans = df["plan_name"].notna().any()
    columns = ["Model", "Arch", "Stack", *(["Settings"] if points else []), *(["Plan"] if plans else []),
               "Bitwise parity", "poros s/step (median±std)", *(f"{m} s/step" + (" (median±std)" if m == ref else "")
                                                               for m in others),
               *(f"{'Slowdown ' if i == 0 else ''}vs {m}" for i, m in enumerate(others)), "poros VRAM",
               *(f"{m} VRAM" for m in others), *(f"{'VRAM cut ' if i == 0 else ''}vs {m}" for i, m in enumerate(others))]
    rows, marked = [], False
    for (model, stack, point), c in _cells(df).items():
        o = [c.get(m) for m in others]
        for plan, p in (c["plans"] or {None: None}).items():
            ps, pv = _ok(p, "s_per_step_median"), _ok(p, "peak_vram_gb")
            apart = ["" if x is None or p is None or len(row_gpus(p) | row_gpus(x)) == 1 else APART for x in o]
            speed = [DASH if ps is None or _ok(x, "s_per_step_median") is None
                     else f"{ps / _ok(x, 's_per_step_median'):.2f}×{a}" for x, a in zip(o, apart)]
            cut = [DASH if pv is None or not _ok(x, "peak_vram_gb")
                   else f"{(1 - pv / _ok(x, 'peak_vram_gb')) * 100:.1f}%" for x in o]
            rows.append([model, c["arch"], stack, *([point or DASH] if points else []),
                         *([plan or DASH] if plans else []), _parity(p or o[0]), _s_step(p, True),
                         *(_s_step(x, i == 0) for i, x in enumerate(o)), *speed, fmt_gb(pv),
                         *(fmt_gb(_ok(x, "peak_vram_gb")) for x in o), *cut])
            marked = marked or any(a and "×" in x for a, x in zip(apart, speed))
    note = f"\n\n{APART_NOTE}" if marked else ""
    if on_cpu(df):
        vram = 1 + 2 * len(others)
        return md_table(columns[:-vram], [r[:-vram] for r in rows]) + note
    return md_table(columns, rows) + note


def time_table(df: pd.DataFrame) -> str:
    """Where each poros row's time goes: bytes copied, the copy rate, the share hidden behind compute; where rows
    carry a link probe, the step's floors and how near it runs to them (`floor.with_floors` adds them to `df`)."""
    floors = probed(df)
    rows = []
    for (model, stack, point), c in _cells(df).items():
        for plan, p in c["plans"].items():
            h2d, gbps, hidden, tps = (_ok(p, f) for f in
                                      ("bytes_h2d_per_step", "copy_gbps", "copy_hidden_share", "tokens_per_s"))
            rows.append([named(model, point, plan), stack, DASH if h2d is None else f"{h2d / 1e9:.2f} GB",
                         DASH if gbps is None else f"{gbps:.1f} GB/s",
                         DASH if hidden is None else f"{hidden * 100:.1f}%", DASH if tps is None else f"{tps:.1f}",
                         *(floor_cells(p) if floors else [])])
    columns = ["Model", "Stack", "Host→device per step", "Copy GB/s (weights)", "Copy hidden behind compute",
               "Tokens/s", *(FLOOR_COLUMNS if floors else ())]
    return md_table(columns, rows) + (f"\n\n{FLOOR_NOTE}" if floors else "")


MEMORY_NOTE = ("Tokens/s: tokens a step over s/step. Peak allocated: the tensors' peak as PyTorch counts them "
               "(the VRAM columns above); process (NVML): the process's peak as nvidia-smi counts it (the CUDA "
               "context and the allocator's reserve included), which a VRAM budget holds; predicted: the "
               "planner's figure for that peak when the row ran (`poros plan`), and how far it was from it.")


def memory_table(df: pd.DataFrame) -> str:
    """Each timed row's tokens/s (poros's against Unsloth's of the same cell) and its process's peak as NVML counted
    it beside the planner's prediction and the budget; empty where no row carries an NVML peak."""
    records = [r for r in df.to_dict("records") if r["status"] == "ok"]
    if not any(num(r.get("peak_vram_nvml_gb")) for r in records):
        return ""
    by_cell = _cells(df)
    peer = next((m for m in UNGATED if m in set(df["method"])), UNGATED[0])  # the trainer poros is set beside
    rows = []
    for r in records:
        c = by_cell[(r["model"], r["stack"], r.get("point", ""))]
        tps, other = num(r.get("tokens_per_s")), c.get(peer)
        theirs = None if other is None or not is_planned(r["method"]) else _ok(other, "tokens_per_s")
        apart = "" if theirs is None or len(row_gpus(r) | row_gpus(other)) == 1 else APART
        nvml, predicted = num(r.get("peak_vram_nvml_gb")), num(r.get("predicted_process_vram_gb"))
        budget = num(r["config"].get("vram_budget")) if is_planned(r["method"]) else None
        rows.append([named(r["model"], r.get("point"), r.get("plan_name")), r["method"], DASH if tps is None else f"{tps:.1f}",
                     DASH if tps is None or not theirs else f"{tps / theirs:.3f}×{apart}",
                     fmt_gb(num(r.get("peak_vram_gb"))), fmt_gb(nvml), fmt_gb(predicted),
                     DASH if not nvml or predicted is None else f"{(predicted / nvml - 1) * 100:+.1f}%",
                     DASH if budget is None else fmt_gb(budget / 1e9)])
    columns = ["Model", "Method", "Tokens/s", f"Tokens/s vs {peer}", "Peak allocated", "Process (NVML)",
               "Predicted (process)", "Predicted vs NVML", "VRAM budget"]
    return md_table(columns, rows) + f"\n\n{MEMORY_NOTE}"


def runs_text(df: pd.DataFrame) -> str:
    return uniq(steps_by_passes(s, p) for s, p in zip(df["steps"], df["passes"]))


def warmup_text(df: pd.DataFrame) -> str:
    """What came before the timed passes: `warm-up discarded`, or `no warm-up` where no row ran one."""
    none = all(num(w) == 0 for w in df["warmup_passes"])
    return "no warm-up" if none else "warm-up discarded"


def _setting_rows(df: pd.DataFrame) -> list[tuple[str, str]]:
    """A row per training setting (poros/settings.py): what is computed over every row, how poros
    schedules it over the poros rows (distinct values joined by "; "); a setting a row predates reads
    as its default."""

    out = []
    poros = [r for r in df.to_dict("records") if is_planned(r["method"])]
    cpu = on_cpu(df)
    for s in SETTINGS:
        if s.kind not in (COMPUTED, SCHEDULE) or (cpu and s.gpu_only):
            continue
        if s.kind == COMPUTED:
            configs, show = list(df["config"]), (lambda c, s=s: setting_shown(s, c))
        else:
            configs, show = poros, (lambda r, s=s: planned_shown(s, r))
        if not configs:
            continue
        if not s.report_default and all(show(c) == s.show(s.default) for c in configs):
            continue
        if s.kind == COMPUTED:  # a method that ran with its own value (a matrix's method_settings) is named
            by_method: dict = {}
            for c, m in zip(df["config"], df["method"]):
                by_method.setdefault(m, []).append(show(c))
            values = {m: uniq(v, "; ") for m, v in by_method.items()}
            if len(set(values.values())) > 1 and all("; " not in v for v in values.values()):
                methods: dict = {}
                for m, v in values.items():
                    methods.setdefault(v, []).append(m)
                out.append((s.label, "; ".join(f"{v} ({', '.join(ms)})" for v, ms in methods.items())))
                continue
        out.append((s.label if s.kind == COMPUTED else f"{s.label} (poros)", uniq(map(show, configs), "; ")))
    return out


def config_table(df: pd.DataFrame, hw: str) -> str:
    cfg = lambda k: [c.get(k) for c in df["config"]]  # noqa: E731
    prov = list(df["provenance"])
    mem = uniq(g.get("memory_gb") for p in prov for g in p.get("gpus") or [] if is_hardware(hw, g.get("name") or ""))
    methods = [m for m in NAMES if m in set(df["method"])]
    bnb = uniq(p.get("versions", {}).get("bitsandbytes") for p in prov)
    rows = [
        ("Hardware", hw + ("" if mem == DASH else f" ({mem} GB VRAM)")),
        ("Precision", uniq(cfg("precision")).upper()),
        ("Steps × passes", f"{runs_text(df)} ({warmup_text(df)}; median ± std across passes)"),
        *_setting_rows(df),
        ("Dataset", uniq(f"`{d}`" for d in cfg("dataset") if d)),
        ("Methods", ", ".join(by_value(m).label for m in methods)),
        ("Software stacks", uniq(df["stack"], " and ") + ("" if bnb == DASH else f", bitsandbytes {bnb}")),
    ]
    return md_table(("Field", "Value"), rows)


def provenance_line(df: pd.DataFrame) -> str:
    prov = list(df["provenance"])
    ver = lambda k: uniq(p.get("versions", {}).get(k) for p in prov)  # noqa: E731
    git = uniq(f"{g.get('commit') or 'unknown'}{' (dirty)' if g.get('dirty') else ''}"
                for g in (p.get("git") or {} for p in prov))
    gpus = uniq(f"{g.get('name')} (UUID {g.get('uuid')}, driver {g.get('driver')})"
                 for p in prov for g in p.get("gpus") or [])
    times = sorted(t for t in (p.get("time") for p in prov) if t)
    span = f"{times[0]} → {times[-1]}" if times else DASH
    cuda = "" if on_cpu(df) else f"CUDA {uniq(p.get('cuda') for p in prov)}, "
    gpu = "" if on_cpu(df) else f"GPU {gpus}; "
    return (f"Provenance: poros {ver('poros')} at commit {git}; torch {uniq(p.get('torch') for p in prov)}, "
            f"{cuda}transformers {ver('transformers')}, bitsandbytes {ver('bitsandbytes')}, peft {ver('peft')}; "
            f"{gpu}host {uniq(p.get('host') for p in prov)}; rows recorded {span}.")


def reference_table(df: pd.DataFrame, ref: pd.DataFrame) -> str:
    """Each reference row whose model was measured, beside the cells measured on the reference row's stack
    (`same_stack`: torch's version and build and transformers' version); — where none was."""
    cells, rows = _cells(df), []
    baseline = REFERENCES[0]
    for r in ref.to_dict("records"):
        if not any(model.lower() == str(r["model"]).lower() for model, _, _ in cells):
            continue
        c = next((c for (m, s, _), c in cells.items()
                  if m.lower() == str(r["model"]).lower() and same_stack(s, r["stack"])), {})
        med, std = num(r["poros_s_step_median"]), num(r["poros_s_step_std"])
        ref_poros = DASH if med is None else (f"{med:.4f}" if std is None else f"{med:.4f}±{std:.4f}")
        ref_res = num(r["resident_s_step"])
        rows.append([r["model"], text_or_none(r["hardware"]) or DASH, text_or_none(r["stack"]) or DASH,
                     ref_poros, _s_step(c.get(PLANNED), True),
                     DASH if ref_res is None else f"{ref_res:.4f}", _s_step(c.get(baseline), True),
                     fmt_gb(num(r["poros_vram_gb"])), fmt_gb(_ok(c.get(PLANNED), "peak_vram_gb")),
                     fmt_gb(num(r["resident_vram_gb"])), fmt_gb(_ok(c.get(baseline), "peak_vram_gb"))])
    cols = ("Model", "Reference hardware", "Reference stack", "ref poros s/step", "measured poros s/step",
            "ref resident s/step", "measured resident s/step", "ref poros VRAM", "measured poros VRAM",
            "ref resident VRAM", "measured resident VRAM")
    if not rows:
        return "No model is present in both the reference and the results."
    source = f"Reference figures: {ref.attrs['source']}. " if ref.attrs.get("source") else ""
    measured = uniq(df["stack"], " and ")
    return md_table(cols, rows) + (f"\n\n{source}Measured cells stand beside a reference row only where they ran "
                                   f"on its stack (torch's version and CUDA build, and transformers' version); — "
                                   f"where none did (measured here: {measured}).")


def _ratio(a: float | None, b: float | None, *, cut: bool = False) -> str:
    if a is None or not b:
        return DASH
    return f"{(1 - a / b) * 100:.1f}%" if cut else f"{a / b:.2f}×"


def attention_text(rows: dict) -> str:
    """The attention path each method ran, from its rows' settings: `all methods fast`, or per method."""
    paths = {m: (r.get("config") or {}).get("attention") for m, r in rows.items() if r is not None}
    if len(set(paths.values())) == 1:
        return f"all methods {next(iter(paths.values()))}"
    return "; ".join(f"{m} {a}" for m, a in paths.items())


def hardware_table(df: pd.DataFrame, ref: pd.DataFrame) -> str:
    """Per model, this page's figures beside every reference row of the model, each named with its hardware,
    stack and attention paths: the ratios (poros against resident and Unsloth, VRAM cut) compare across
    hardware where seconds do not. No row is paired with another: each stands for its own run."""
    others = [REFERENCES[0], *UNGATED]
    columns = ["Model", "Hardware", "Stack", "Attention", "poros s/step", *(f"{m} s/step" for m in others),
               *(f"{'Slowdown ' if i == 0 else ''}vs {m}" for i, m in enumerate(others)), "poros VRAM",
               *(f"{m} VRAM" for m in others), *(f"{'VRAM cut ' if i == 0 else ''}vs {m}" for i, m in enumerate(others))]
    hw = uniq(df["hardware"]) if "hardware" in df else DASH
    rows = []
    for (model, stack, point), c in _cells(df).items():
        if point:
            continue
        p = c.get(PLANNED)
        o = [c.get(m) for m in others]
        ps, pv = _ok(p, "s_per_step_median"), _ok(p, "peak_vram_gb")
        os_, ov = [_ok(x, "s_per_step_median") for x in o], [_ok(x, "peak_vram_gb") for x in o]
        rows.append([model, f"{hw} (this page)", stack, attention_text({m: c.get(m) for m in (PLANNED, *others)}),
                     _s_step(p, True), *(_s_step(x) for x in o), *(_ratio(ps, s) for s in os_), fmt_gb(pv),
                     *(fmt_gb(v) for v in ov), *(_ratio(pv, v, cut=True) for v in ov)])
        for r in ref.to_dict("records"):
            if str(r["model"]).lower() != str(model).lower():
                continue
            med, std = num(r["poros_s_step_median"]), num(r["poros_s_step_std"])
            rs = [num(r.get(f"{m}_s_step")) for m in others]
            rv = [num(r.get(f"{m}_vram_gb")) for m in others]
            rpv = num(r["poros_vram_gb"])
            rows.append([model, text_or_none(r["hardware"]) or DASH, text_or_none(r["stack"]) or DASH,
                         text_or_none(r.get("attention_note")) or DASH,
                         DASH if med is None else (f"{med:.4f}" if std is None else f"{med:.4f}±{std:.4f}"),
                         *(DASH if s is None else f"{s:.4f}" for s in rs), *(_ratio(med, s) for s in rs),
                         fmt_gb(rpv), *(fmt_gb(v) for v in rv), *(_ratio(rpv, v, cut=True) for v in rv)])
    if not rows:
        return "No model is present in both the reference and the results."
    source = f"Reference figures: {ref.attrs['source']}. " if ref.attrs.get("source") else ""
    return md_table(columns, rows) + (f"\n\n{source}Each row is one run on its own hardware and stack; compare the "
                                      f"ratios and the VRAM across rows, not the seconds. The reference rows' ratios "
                                      f"are computed from its published (rounded) figures: a last digit may differ "
                                      f"from its own table's.")


def protocol_line(df: pd.DataFrame) -> str:
    """How every cell of the page was measured, in one line: steps × passes, the discarded warm-up, the gate."""
    timed = df[df["status"] == "ok"].to_dict("records")
    if not timed:
        return ""
    def measured(r: dict) -> str:  # a cell's timed passes and the warm-up passes discarded before them
        runs, passes = steps_by_passes(r["steps"], r["passes"]), num(r.get("warmup_passes"))
        warm = num(r.get("warmup_pass_steps", r.get("warmup_steps")))
        if passes == 0:
            return f"{runs} with no warm-up pass"
        if passes is not None and passes > 1:
            return f"{runs} after {passes:g} discarded warm-up passes" + ("" if warm is None else f" of {warm:g} steps")
        return f"{runs} after a discarded {'warm-up pass' if warm is None else f'{warm:g}-step warm-up'}"

    protocols = uniq((measured(r) for r in timed), sep="; ")
    gated = [r for r in timed if text_or_none(r.get("parity")) is not None and is_planned(r["method"])]
    against = uniq(text_or_none(r.get("gate")) or REFERENCES[0] for r in gated)
    gate = (f"; every {PLANNED} cell first gated bitwise against {against} on the same settings "
            f"({uniq(r['parity'] for r in gated)})") if gated else ""
    return (f"**Protocol:** each cell {protocols} in its process, s/step the median ± "
            f"std across passes{gate}.")
