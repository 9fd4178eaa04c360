"""The tables of a sweep page (`poros report --sweep`): every measured row of one or more sweeps, each
compared only with the reference of its own run on its own GPU; data-parallel scaling, attention settings
against math, and the attention backends."""

from __future__ import annotations

import pandas as pd

from poros.config import Method
from poros.engine.methods.method_info import REFERENCES, by_value, is_planned
from poros.harness.report.floor import FLOOR_COLUMNS, floor_cells
from poros.harness.report.format import DASH, fmt_gb, md_table, num, text_or_none
from poros.harness.report.rows import frame, gpu_uuid, point_label, run_of
from poros.sizes import is_auto

SWEEP_COLUMNS = ("Model", "GPUs", "GPU", "Seq", "Attention", "Grad-accum", "Method / plan", "Schedule",
                 "Parity (gate)", "s/step", "vs resident", "Tokens/s", "Peak VRAM", "Peak reserved", "Predicted peak",
                 "Host→device per step", "Copy hidden", "Resident layers", "Block")
SCALING_COLUMNS = ("Model", "Method / plan", "Seq", "Grad-accum", "GPU", "GPUs", "Tokens/s", "Tokens/s on 1 GPU",
                   "Speed-up", "Per-GPU efficiency")
ATTENTION_COLUMNS = ("Model", "Method / plan", "Seq", "GPU", "Attention", "s/step", "s/step on math", "vs math",
                     "Tokens/s", "Tokens/s on math", "Peak VRAM", "Peak VRAM on math")
FLOOR_ROW_COLUMNS = ("Model", "GPUs", "GPU", "Seq", "Method / plan", "Schedule", "s/step", *FLOOR_COLUMNS)
UNSLOTH_COLUMNS = ("Model", "GPU", "Seq", "Method / plan", "Schedule", "Tokens/s", "Unsloth tokens/s", "vs Unsloth",
                   "Peak (NVML)", "Unsloth peak (NVML)", "Share of Unsloth's", "Predicted (process)", "Predicted vs NVML")
UNSLOTH_NOTE = ("Each poros plan beside Unsloth as its users run it, on the same work in the same run on the same GPU: "
                "tokens/s and their ratio (above 1×: poros is faster), the process's peak device memory as NVML counts "
                "it (what a VRAM budget holds) and its share of Unsloth's, and the planner's prediction of that peak, "
                "made before the run, against it.")
# what a row computes, but its GPUs
TASK = ("model", "stack", "seq_len", "grad_accum", "attention", "loss_chunk", "mlp_chunk",
        "attention_chunk")
SWEEP_INTRO = (
    "Each poros plan first passed the parity gate against the reference's states recorded in the same run "
    "(torch.equal on every loss, LoRA gradient, weight and AdamW tensor), then was timed {warmup}. "
    "`vs resident` divides by the s/step of the reference (resident QLoRA, else resident_gc) of the same work "
    "(model, sequence length, attention, gradient accumulation, number of GPUs) in the same run on the same GPU; "
    "the GPU column names a run's (first) GPU by its UUID's first 8 hex digits. Unsloth is timed on the same store "
    "but not gated (its arithmetic differs); a control row gates the reference against its own recorded states. "
    "Peak VRAM is torch's allocated peak, Peak reserved its reserved one (CUDA graphs keep their intermediates in "
    "private pools, reserved but not allocated; rows from before it was recorded show —), Predicted peak the "
    "planner's. Under data parallelism (GPUs > 1) every rank trains its own data: tokens/s counts every rank's "
    "tokens, the peak is the largest rank's.")


def sweep_intro(rows: pd.DataFrame) -> str:
    """`SWEEP_INTRO` as the rows were timed: after discarded warm-up, or with none where no row ran one."""
    none = all(num(w) == 0 for w in rows["warmup_passes"])
    return SWEEP_INTRO.format(warmup="with no warm-up pass" if none else "after discarded warm-up")


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
        kept = config.get("device_inputs")
        parts.append("inputs in host memory" + ("" if not kept else f" (the last {kept} layers' on the device)"))
    if config.get("overlap_backward") is False:
        parts.append("serial backward")
    if config.get("accumulation") not in (None, "layer"):
        parts.append(f"{config['accumulation']}-major accumulation")
    if config.get("keep_activations"):
        kept = config.get("kept_layers")
        parts.append("activations kept" + (" where the budget holds them" if is_auto(config["keep_activations"])
                                           else "") + ("" if kept is None else f" ({kept} layers)"))
    if config.get("keep_attention"):
        parts.append("attention kept")
    if config.get("cuda_graphs"):
        parts.append("CUDA graphs")
    return parts


def _sweep_row(r: dict) -> dict:
    """A row with the columns a sweep page groups by: what it computed, where and in which run it ran."""
    c, p = r["config"], r["provenance"]
    uuid = gpu_uuid(r)
    poros, control = is_planned(r["method"]), r.get("control") is True  # a column other rows lack reads NaN
    out = {**r, **{k: c.get(k) for k in TASK[2:]}, "grad_accum": c.get("grad_accum") or 1,
           "gpus": int(num(r.get("world_size")) or c.get("gpus") or 1), "gpu": uuid,
           "gpu_label": uuid.removeprefix("GPU-")[:8], "host": p.get("host"), "control": control,
           "label": " ".join(x for x in (r["method"], poros and text_or_none(r.get("plan_name")), control and "(control)")
                             if x),
           "schedule": schedule(c) if poros else DASH, "point": point_label(r["sweep"]),
           "timed_ok": r["status"] == "ok" and not control and num(r["s_per_step_median"]) is not None}
    out["run"] = run_of(r)
    out["task"] = " | ".join(str(out[k]) for k in TASK)
    out["work"] = f"{out['task']} | {out['gpus']}"
    return out


def sweep_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of a sweep page, in order; a row repeating a cell of its run (work, method, plan, sweep point,
    control or not) replaces the earlier one."""
    rows = frame([_sweep_row(r) for r in df.to_dict("records")])
    rows["plan_key"] = rows["plan_name"].fillna("")
    keys = ["run", "work", "method", "plan_key", "point", "control"]
    return rows.drop_duplicates(subset=keys, keep="last").reset_index(drop=True)


def baselines(rows: pd.DataFrame) -> pd.Series:
    """s/step of the reference per (run, work): plain resident over resident_gc (`REFERENCES`' order)."""
    ref = rows[rows["method"].isin(REFERENCES) & rows["timed_ok"]]
    ref = ref.assign(preference=ref["method"].map(REFERENCES.index)).sort_values("preference", kind="stable")
    return ref.groupby(["run", "work"])["s_per_step_median"].first()


def _steps(n) -> str:
    return DASH if num(n) is None else f"{int(n)} step" if int(n) == 1 else f"{int(n)} steps"


def _gate_words(r: dict) -> str:
    """What a row's gate held it to: `N steps, vs resident`; the reference's own row took part as the reference
    (rows from before `gate` was recorded: a reference method's row did)."""
    gate = text_or_none(r.get("gate"))
    reference = r["method"] == gate or (gate is None and r["method"] in REFERENCES)
    parts = [_steps(r.get("parity_steps")) if num(r.get("parity_steps")) is not None else None,
             "as the gate's reference" if reference else gate and f"vs {gate}",
             f"gated under {int(r['alone_of'])} ranks" if num(r.get("alone_of")) else None]
    return ", ".join(x for x in parts if x)


def _sweep_parity(r: dict) -> str:
    words = _gate_words(r)
    verdict = None if text_or_none(r["parity"]) is None else r["parity"] + (f" ({words})" if words else "")
    if r["status"] != "ok":
        reason = str(r.get("error") or r["status"]).split(":", 1)[-1].strip().replace("\n", " ")
        return f"{verdict}; not timed: {reason}" if verdict else f"not run: {reason}"
    if r["control"]:
        return f"{r['parity']} (control: reference vs itself, {_steps(r.get('parity_steps'))})"
    if not by_value(r["method"]).gated:
        return "not gated (other arithmetic)"
    return verdict or DASH


def _fmt(v, fmt: str) -> str:
    return DASH if num(v) is None else fmt.format(num(v))


def _scaled(v, by: float, fmt: str) -> str:
    return DASH if num(v) is None else fmt.format(num(v) * by)


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
                           fmt_gb(num(r["peak_vram_gb"])), fmt_gb(num(r.get("peak_reserved_gb"))),
                           fmt_gb(num(r.get("predicted_peak_vram_gb"))), _scaled(r["bytes_h2d_per_step"], 1e-9, "{:.2f} GB"),
                           _scaled(r["copy_hidden_share"], 100, "{:.0f}%"),
                           _fmt(r.get("resident_layers"), "{:.0f}"), _fmt(plan.get("block_size"), "{:.0f}")])
    return md_table(SWEEP_COLUMNS, out)


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
    return md_table(SCALING_COLUMNS, out) if out else None


def attention_pairs(rows: pd.DataFrame) -> pd.DataFrame:
    """Each timed row of another attention setting beside the latest math row of the same run, method/plan and
    work but for attention (columns `_other`, `_math`)."""
    timed = rows[rows["timed_ok"]].reset_index()
    timed = timed.assign(same=[" | ".join(str(r[k]) for k in ("run", "model", "stack", "seq_len", "grad_accum",
                                                              "loss_chunk", "mlp_chunk", "attention_chunk", "gpus",
                                                              "label"))
                               for r in timed.to_dict("records")])
    other, math_ = timed[timed["attention"] != "math"], timed[timed["attention"] == "math"]
    pairs = other.merge(math_, on="same", suffixes=("_other", "_math"))
    return pairs.drop_duplicates(subset="index_other", keep="last")


def attention_table(rows: pd.DataFrame) -> str | None:
    out = [[p["model_other"], p["label_other"], _fmt(p["seq_len_other"], "{:.0f}"), p["gpu_label_other"],
            str(p["attention_other"]), f"{p['s_per_step_median_other']:.4f}", f"{p['s_per_step_median_math']:.4f}",
            f"{p['s_per_step_median_other'] / p['s_per_step_median_math']:.2f}×",
            _fmt(p["tokens_per_s_other"], "{:.0f}"), _fmt(p["tokens_per_s_math"], "{:.0f}"),
            fmt_gb(num(p["peak_vram_gb_other"])), fmt_gb(num(p["peak_vram_gb_math"]))]
           for p in attention_pairs(rows).to_dict("records")]
    return md_table(ATTENTION_COLUMNS, out) if out else None


def backends_table(rows: pd.DataFrame) -> str | None:
    """Which SDPA backend ran for which attention shape, per model and attention setting, and for which methods."""
    seen: dict[tuple, set] = {}
    for r in rows.to_dict("records"):
        for shape, backend in (r.get("attention_backends") or {}).items():
            seen.setdefault((r["model"], str(r["attention"]), shape, backend), set()).add(r["method"])
    if not seen:
        return None
    return md_table(("Model", "Attention setting", "Layer shape", "Backend", "Methods"),
                  [[*k, ", ".join(sorted(ms))] for k, ms in seen.items()])


def floor_table(rows: pd.DataFrame) -> str | None:
    """Each timed row with a copy floor beside its floors (`floor.with_floors` adds them to `rows`); None when no
    row has one (rows from before the link probe was recorded)."""
    out = [[r["model"], str(r["gpus"]), r["gpu_label"], _fmt(r["seq_len"], "{:.0f}"), r["label"], r["schedule"],
            f"{r['s_per_step_median']:.4f}", *floor_cells(r)]
           for r in rows.to_dict("records") if r["timed_ok"] and num(r.get("copy_floor_s")) is not None]
    return md_table(FLOOR_ROW_COLUMNS, out) if out else None


def _share(a, b, fmt: str, minus: float = 0.0) -> str:
    a, b = num(a), num(b)
    return DASH if a is None or not b else fmt.format(a / b - minus)


def unsloth_table(rows: pd.DataFrame) -> str | None:
    """Each timed poros row beside the Unsloth row of the same run and work (of the same sweep point where there
    is one); None when no poros row has one."""
    timed = [r for r in rows.to_dict("records") if r["timed_ok"]]
    unsloth: dict[tuple, dict] = {}
    for r in timed:
        if r["method"] == Method.UNSLOTH.value:
            unsloth.setdefault((r["run"], r["work"]), r)
            unsloth[(r["run"], r["work"], r["point"])] = r
    out = []
    for r in timed:
        u = unsloth.get((r["run"], r["work"], r["point"])) or unsloth.get((r["run"], r["work"]))
        if not is_planned(r["method"]) or u is None:
            continue
        out.append([r["model"], r["gpu_label"], _fmt(r["seq_len"], "{:.0f}"), r["label"], r["schedule"],
                    _fmt(r["tokens_per_s"], "{:.0f}"), _fmt(u["tokens_per_s"], "{:.0f}"),
                    _share(r["tokens_per_s"], u["tokens_per_s"], "{:.2f}×"), _nvml(r), _nvml(u),
                    _share(r.get("peak_vram_nvml_gb"), u.get("peak_vram_nvml_gb"), "{:.0%}"),
                    fmt_gb(num(r.get("predicted_process_vram_gb"))),
                    _share(r.get("predicted_process_vram_gb"), r.get("peak_vram_nvml_gb"), "{:+.1%}", minus=1.0)])
    return md_table(UNSLOTH_COLUMNS, out) if out else None


def _nvml(r: dict) -> str:
    """A row's NVML peak as the table shows it: the process's, or marked where NVML counted the whole device (every
    process on it: no budget holds that)."""
    shown = fmt_gb(num(r.get("peak_vram_nvml_gb")))
    return shown if shown == DASH or r.get("peak_vram_nvml_source") in (None, "process") else f"{shown} (device)"
