"""The tables of a matrix page: configuration, results per model and method, where poros's time goes,
reference against measured figures, and the provenance line."""

from __future__ import annotations

import re
import statistics

import pandas as pd

from poros.engine.methods.method_info import NAMES, PLANNED, REFERENCES, UNGATED, by_value, is_planned
from poros.harness.report.floor import FLOOR_COLUMNS, FLOOR_NOTE, floor_cells, probed
from poros.harness.report.format import DASH, fmt_gb, md_table, num, steps_by_passes, text_or_none, uniq
from poros.harness.report.rows import (budget_bytes, named, on_cpu, passes_by_gpu, planned_shown, row_gpus,
                                      setting_shown)
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


def s_step_text(row, with_std: bool = False) -> str:
    if row is None or row["status"] == "skipped":
        return DASH
    if row["status"] == "failed":
        return "FAIL"
    med, std = num(row["s_per_step_median"]), num(row["s_per_step_std"])
    if med is None:
        return DASH
    mark = SPREAD_MARK if spread(row) else ""
    return (f"{med:.4f}±{std:.4f}" if with_std and std is not None else f"{med:.4f}") + mark


def ok_value(row, field: str) -> float | None:
    return num(row[field]) if row is not None and row["status"] == "ok" else None


def parity_text(row) -> str:
    if row is None or text_or_none(row["parity"]) is None:
        return DASH
    diff = num(row["parity_max_abs_diff"])
    gate = text_or_none(row.get("gate"))
    against = "" if gate in (None, REFERENCES[0]) else f" vs {gate}"  # rows say which reference the gate ran
    if row["parity"] == "PASS":
        return f"PASS{against}" if diff is None else f"PASS{against} ({diff:.2e})"
    return f"FAIL{against}" if diff is None else f"FAIL{against} (max |diff| {diff:.2e})"


def cells_of(df: pd.DataFrame) -> dict:
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


APART = "other GPU"  # where a ratio's two rows ran on different GPUs: no ratio is printed
APART_NOTE = ("other GPU: the two rows of this ratio ran on different GPUs (their UUIDs differ, or one row's passes "
              "ran on more than one), and GPUs of one model differ in speed, so no ratio is printed: measure both "
              "methods on one GPU (one run) to compare them.")
PAIRED_NOTE = ("(N GPUs): the two rows' passes ran on N GPUs, each GPU timing passes of both (a run in parts, "
               "`--passes-per-part`, where a model's cells outlast one machine); the ratio is the median over those "
               "GPUs of the ratio on each GPU, so it too compares two methods on one GPU.")
PAIRED = re.compile(r" \(\d+ GPUs\)$")
# a ratio of per-pass times read GPU by GPU: s/step scales with a pass's seconds, tokens/s inversely
PER_PASS_POWER = {"s_per_step_median": 1, "tokens_per_s": -1}


def one_gpu(a, b) -> bool:
    """Whether rows `a` and `b` (either may be None) ran on one GPU, every pass of both: a ratio of theirs compares
    methods, not machines."""
    return a is None or b is None or len(row_gpus(a) | row_gpus(b)) == 1


def gpu_paired_ratio(a, b, field: str) -> tuple[float, int] | None:
    """`a`'s `field` over `b`'s GPU by GPU, where both rows timed passes on the same two or more GPUs: the median
    over those GPUs of the ratio of their medians there, and how many GPUs; None where they did not (a GPU with
    passes of one row only, a pass naming no GPU, or a field that is not read from pass times)."""
    power = PER_PASS_POWER.get(field)
    pa, pb = passes_by_gpu(a), passes_by_gpu(b)
    if power is None or pa is None or pb is None or set(pa) != set(pb) or len(pa) < 2:
        return None
    ratios = [(statistics.median(pa[g]) / a["steps"]) / (statistics.median(pb[g]) / b["steps"]) for g in sorted(pa)]
    return statistics.median(r ** power for r in ratios), len(ratios)


def _rows_ratio(a, b, field: str, fmt: str) -> str:
    """`a`'s `field` over `b`'s as `fmt` prints it; — where either is missing; where they ran on several GPUs, the
    ratio GPU by GPU with the number of GPUs (`gpu_paired_ratio`), else `APART`."""
    x, y = ok_value(a, field), ok_value(b, field)
    if x is None or not y:
        return DASH
    if one_gpu(a, b):
        return fmt.format(x / y)
    paired = gpu_paired_ratio(a, b, field)
    return APART if paired is None else fmt.format(paired[0]) + f" ({paired[1]} GPUs)"


def ratio_notes(cells) -> str:
    """The notes the ratios printed in `cells` need: why one is missing (`APART`), how a paired one was read."""
    notes = [note for note, shown in ((APART_NOTE, any(c == APART for c in cells)),
                                      (PAIRED_NOTE, any(PAIRED.search(c) for c in cells))) if shown]
    return "".join(f"\n\n{n}" for n in notes)


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
    rows, ratios = [], []
    for (model, stack, point), c in cells_of(df).items():
        o = [c.get(m) for m in others]
        for plan, p in (c["plans"] or {None: None}).items():
            pv = ok_value(p, "peak_vram_gb")
            speed = [_rows_ratio(p, x, "s_per_step_median", "{:.2f}×") for x in o]
            cut = [DASH if pv is None or not ok_value(x, "peak_vram_gb")
                   else f"{(1 - pv / ok_value(x, 'peak_vram_gb')) * 100:.1f}%" for x in o]
            rows.append([model, c["arch"], stack, *([point or DASH] if points else []),
                         *([plan or DASH] if plans else []), parity_text(p or o[0]), s_step_text(p, True),
                         *(s_step_text(x, i == 0) for i, x in enumerate(o)), *speed, fmt_gb(pv),
                         *(fmt_gb(ok_value(x, "peak_vram_gb")) for x in o), *cut])
            ratios += speed
    note = ratio_notes(ratios)
    if on_cpu(df):
        vram = 1 + 2 * len(others)
        return md_table(columns[:-vram], [r[:-vram] for r in rows]) + note
    return md_table(columns, rows) + note


def headline_table(df: pd.DataFrame) -> str:
    """README's headline: per model (poros's first plan) the gate, s/step of poros and of each other method, poros's
    ratio to each, and the peak VRAM of each; the official page's results table without its stack and arch."""
    present = set(df["method"])
    others = [next((m for m in REFERENCES if m in present), REFERENCES[0]), *(m for m in UNGATED if m in present)]
    columns = ["Model", "Bitwise parity", "poros s/step", *(f"{m} s/step" for m in others),
               *(f"poros vs {m}" for m in others), "poros VRAM", *(f"{m} VRAM" for m in others)]
    rows, ratios = [], []
    for (model, _stack, _point), c in cells_of(df).items():
        p, o = c.get(PLANNED), [c.get(m) for m in others]
        speed = [_rows_ratio(p, x, "s_per_step_median", "{:.2f}×") for x in o]
        ratios += speed
        rows.append([model, parity_text(p).split(" (")[0], s_step_text(p), *(s_step_text(x) for x in o), *speed,
                     fmt_gb(ok_value(p, "peak_vram_gb")), *(fmt_gb(ok_value(x, "peak_vram_gb")) for x in o)])
    return md_table(columns, rows) + ratio_notes(ratios)


def time_table(df: pd.DataFrame) -> str:
    """Where each poros row's time goes: bytes copied, the copy rate, the share hidden behind compute; where rows
    carry a link probe, the step's floors and how near it runs to them (`floor.with_floors` adds them to `df`)."""
    floors = probed(df)
    rows = []
    for (model, stack, point), c in cells_of(df).items():
        for plan, p in c["plans"].items():
            h2d, gbps, hidden, tps = (ok_value(p, f) for f in
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
               "context and the allocator's reserve included), which a VRAM budget holds, and its share of the "
               "peak of the trainer poros is set beside in the same cell (printed for rows of two GPUs too: a "
               "process's peak does not move with the host's speed, as a step's time does); predicted: the "
               "planner's figure for that peak when the row ran (`poros plan`), and how far it was from it.")


def memory_table(df: pd.DataFrame) -> str:
    """Each timed row's tokens/s (poros's against Unsloth's of the same cell) and its process's peak as NVML counted
    it beside the planner's prediction and the budget; empty where no row carries an NVML peak."""
    records = [r for r in df.to_dict("records") if r["status"] == "ok"]
    if not any(num(r.get("peak_vram_nvml_gb")) for r in records):
        return ""
    by_cell = cells_of(df)
    peer = next((m for m in UNGATED if m in set(df["method"])), UNGATED[0])  # the trainer poros is set beside
    rows = []
    for r in records:
        c = by_cell[(r["model"], r["stack"], r.get("point", ""))]
        tps = num(r.get("tokens_per_s"))
        other = c.get(peer) if is_planned(r["method"]) else None  # only poros rows are set beside the peer
        theirs, their_peak = (None, None) if other is None else (ok_value(other, "tokens_per_s"),
                                                                 ok_value(other, "peak_vram_nvml_gb"))
        nvml, predicted = num(r.get("peak_vram_nvml_gb")), num(r.get("predicted_process_vram_gb"))
        budget = budget_bytes(r) if is_planned(r["method"]) else None
        rows.append([named(r["model"], r.get("point"), r.get("plan_name")), r["method"], DASH if tps is None else f"{tps:.1f}",
                     DASH if tps is None or not theirs else _rows_ratio(r, other, "tokens_per_s", "{:.3f}×"),
                     fmt_gb(num(r.get("peak_vram_gb"))), fmt_gb(nvml),
                     DASH if not nvml or not their_peak else f"{nvml / their_peak:.1%}",
                     fmt_gb(predicted),
                     DASH if not nvml or predicted is None else f"{(predicted / nvml - 1) * 100:+.1f}%",
                     DASH if budget is None else fmt_gb(budget / 1e9)])
    columns = ["Model", "Method", "Tokens/s", f"Tokens/s vs {peer}", "Peak allocated", "Process (NVML)",
               f"Process vs {peer}", "Predicted (process)", "Predicted vs NVML", "VRAM budget"]
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
