"""Schedule sweeps (scripts/sweep.py rows) as a Markdown page and its plots: per model, sequence length,
gradient accumulation and number of GPUs, the reference (resident QLoRA), every poros plan and Unsloth
measured in one run, each poros plan gated against the reference; data-parallel scaling where a sweep
ran both on one GPU and under torchrun on the same machine."""

from __future__ import annotations

from pathlib import Path

from poros.harness.sweep_plots import PLOTS
from poros.harness.sweep_rows import (
    REFERENCES,
    _gpus,
    computed,
    field,
    gpu_label,
    gpu_uuid,
    is_control,
    is_timed,
    load_sweeps,
    plan_name,
    run_of,
    same_machine,
)

DASH = "—"
COLUMNS = ("Model", "GPUs", "GPU", "Seq", "Attention", "Grad-accum", "Method / plan", "Parity (gate)", "s/step",
           "vs resident", "Tokens/s", "Peak VRAM", "Peak reserved", "Predicted peak", "Host→device per step",
           "Copy hidden", "Resident layers", "Block")
SCALING_COLUMNS = ("Model", "Method / plan", "Seq", "Grad-accum", "GPU", "GPUs", "Tokens/s", "Tokens/s on 1 GPU",
                   "Speed-up", "Per-GPU efficiency")
ATTENTION_COLUMNS = ("Model", "Method / plan", "Seq", "GPU", "Attention", "s/step", "s/step on math", "vs math",
                     "Tokens/s", "Tokens/s on math", "Peak VRAM", "Peak VRAM on math")


def _gb(v) -> str:
    return DASH if v is None else f"{v:.2f} GB"


def _num(v, fmt: str = "{}") -> str:
    return DASH if v is None else fmt.format(v)


def _baseline_key(r: dict) -> tuple:
    return computed(r), field(r, "world_size"), gpu_uuid(r), run_of(r)


def _baselines(rows: list[dict]) -> dict[tuple, float]:
    """s/step of the reference per (computed, GPUs, first GPU, run): later rows win, plain resident over
    resident_gc."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if r["method"] in REFERENCES and is_timed(r):
            key = _baseline_key(r)
            if key not in best or REFERENCES.index(r["method"]) <= REFERENCES.index(best[key]["method"]):
                best[key] = r
    return {k: r["s_per_step_median"] for k, r in best.items()}


def _steps(n) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _cells(r: dict, base: float | None) -> list[str]:
    head = [r["model"], str(field(r, "world_size")), gpu_label(r), _num(r.get("seq_len")), _num(r.get("attention")),
            str(field(r, "grad_accum")), plan_name(r)]
    rest = len(COLUMNS) - len(head) - 1
    if "error" in r:
        reason = r["error"].split(":", 1)[-1].strip().replace("|", "/").replace("\n", " ")
        if r.get("parity"):  # gated, then stopped or failed while timed
            return head + [f"{r['parity']} ({_steps(r.get('parity_steps'))}, {r.get('gate')}); not timed: {reason}"] \
                + [DASH] * rest
        return head + ["not run: " + reason] + [DASH] * rest
    if is_control(r):
        parity = f"{r.get('parity')} (control: reference vs itself, {_steps(r.get('parity_steps'))})"
        return head + [parity] + [DASH] * rest
    if r["method"] == "unsloth":
        parity = "not gated (other arithmetic)"
    else:
        parity = DASH if r.get("parity") is None else f"{r['parity']} ({_steps(r.get('parity_steps'))}, {r.get('gate')})"
    s, h2d, hidden = r.get("s_per_step_median"), r.get("bytes_h2d_per_step"), r.get("copy_hidden_share")
    return head + [parity, _num(s, "{:.4f}"), DASH if s is None or not base else f"{s / base:.2f}×",
                   _num(r.get("tokens_per_s"), "{:.0f}"), _gb(r.get("peak_vram_gb")), _gb(r.get("peak_reserved_gb")),
                   _gb(r.get("predicted_peak_vram_gb")), DASH if h2d is None else f"{h2d / 1e9:.2f} GB",
                   DASH if hidden is None else f"{hidden * 100:.0f}%", _num(r.get("resident_layers")),
                   _num(r.get("block_size"))]


def _table(columns, rows_of_cells) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows_of_cells])


def sweep_table(rows: list[dict]) -> str:
    base = _baselines(rows)
    return _table(COLUMNS, (_cells(r, base.get(_baseline_key(r))) for r in rows))


def scaling_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(one-GPU row, data-parallel row) of the same work and method/plan on the same machine, the latest
    one-GPU row for each data-parallel row."""
    timed = [r for r in rows if is_timed(r) and r.get("tokens_per_s") is not None]
    pairs = []
    for many in (r for r in timed if field(r, "world_size") > 1):
        ones = [r for r in timed if field(r, "world_size") == 1 and computed(r) == computed(many)
                and plan_name(r) == plan_name(many) and same_machine(r, many)]
        if ones:
            pairs.append((ones[-1], many))
    return pairs


def scaling_table(rows: list[dict]) -> str | None:
    """Tokens/s of each data-parallel row against the same run on one GPU; None when there is no pair."""
    out = []
    for one, many in scaling_pairs(rows):
        world, ratio = field(many, "world_size"), many["tokens_per_s"] / one["tokens_per_s"]
        gpu = _gpus(many)[0]["name"] if _gpus(many) else "cpu"
        out.append([many["model"], plan_name(many), _num(many.get("seq_len")), str(field(many, "grad_accum")), gpu,
                    str(world), f"{many['tokens_per_s']:.0f}", f"{one['tokens_per_s']:.0f}", f"{ratio:.2f}×",
                    f"{ratio / world * 100:.0f}%"])
    return _table(SCALING_COLUMNS, out) if out else None


def attention_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(row, the same run on math) for timed rows of another attention setting: the same model, sequence
    length, gradient accumulation, loss chunking, method/plan and number of GPUs on the same GPU in the
    same sweep; the latest math row for each."""
    timed = [r for r in rows if is_timed(r)]

    def work(r):  # what a row computes and runs, but for its attention setting
        model, seq, accum, _, chunk = computed(r)
        return model, seq, accum, chunk, plan_name(r), field(r, "world_size"), gpu_uuid(r), run_of(r)

    pairs = []
    for r in (r for r in timed if r.get("attention") not in (None, "math")):
        maths = [m for m in timed if m.get("attention") == "math" and work(m) == work(r)]
        if maths:
            pairs.append((r, maths[-1]))
    return pairs


def attention_table(rows: list[dict]) -> str | None:
    """Each row of another attention setting against the same run on math; None when there is no pair."""
    out = [[r["model"], plan_name(r), _num(r.get("seq_len")), gpu_label(r), str(r["attention"]),
            f"{r['s_per_step_median']:.4f}", f"{m['s_per_step_median']:.4f}",
            f"{r['s_per_step_median'] / m['s_per_step_median']:.2f}×", _num(r.get("tokens_per_s"), "{:.0f}"),
            _num(m.get("tokens_per_s"), "{:.0f}"), _gb(r.get("peak_vram_gb")), _gb(m.get("peak_vram_gb"))]
           for r, m in attention_pairs(rows)]
    return _table(ATTENTION_COLUMNS, out) if out else None


def _provenance(rows: list[dict]) -> str:
    gpus = sorted({f"{g['name']} (UUID {g['uuid']})" for r in rows for g in _gpus(r)})
    commits = sorted({str(r["provenance"].get("git", {}).get("commit")) for r in rows})
    versions = rows[0]["provenance"].get("versions", {})
    return (f"Provenance: commit {', '.join(commits)}; torch {rows[0]['provenance'].get('torch')}, transformers "
            f"{versions.get('transformers')}, bitsandbytes {versions.get('bitsandbytes')}, peft "
            f"{versions.get('peft')}; "
            f"GPU {', '.join(gpus) or 'none'}. Ratios compare rows on one GPU (a data-parallel run's first) only; "
            f"the GPU column names it by its UUID's first 8 hex digits.")


INTRO = ("Each poros plan first passed the parity gate against the reference's states recorded in the same run "
         "(torch.equal on every loss, LoRA gradient, weight and AdamW tensor), then was timed after a discarded "
         "warm-up pass. `vs resident` divides by the reference's s/step (resident QLoRA, else resident_gc) with the "
         "same model, sequence length, gradient accumulation and number of GPUs on the same GPU in the same run. "
         "Unsloth is timed on the same store but not gated (its arithmetic differs); a control row gates the "
         "reference against its own recorded states. Peak VRAM is torch's allocated peak, Peak reserved its "
         "reserved one (CUDA graphs keep their intermediates in private pools, reserved but not allocated; "
         "rows from before it was recorded show —). Under torchrun (GPUs > 1) every rank trains its own data: "
         "tokens/s counts every rank's tokens, the peak is the largest rank's.")


def backends_table(rows: list[dict]) -> str | None:
    """Which SDPA backend ran for which attention shape, per model and method (as the timed rows recorded)."""
    seen: dict[tuple, set] = {}
    for r in rows:
        for shape, backend in (r.get("attention_backends") or {}).items():
            seen.setdefault((r["model"], r.get("attention"), shape, backend), set()).add(r["method"])
    if not seen:
        return None
    return _table(("Model", "Attention setting", "Layer shape", "Backend", "Methods"),
                  ([m, str(a), shape, b, ", ".join(sorted(ms))] for (m, a, shape, b), ms in seen.items()))


def write_sweep_report(paths, out_md, title: str | None = None) -> Path:
    """Render sweep files into `out_md` and its PNGs beside it (stem, stem-accum, stem-seq).

    The main PNG is always written (`poros report` names it); a plot is linked only when the rows hold
    what it needs.
    """

    rows = load_sweeps(paths)
    out_md = Path(out_md)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    parts = [f"# {title or 'Poros — plans measured'}", INTRO, sweep_table(rows)]
    scaling = scaling_table(rows)
    if scaling:
        parts += ["## Data-parallel scaling\n\nTokens/s under torchrun against the same plan on one GPU of the "
                  "same machine; per-GPU efficiency is the speed-up divided by the number of GPUs.", scaling]
    against_math = attention_table(rows)
    if against_math:
        parts += ["## Attention: math against the fast path\n\nEach method or plan on another attention setting "
                  "against the same run on math (same store, same GPU, one process); `vs math` divides the "
                  "s/step.", against_math]
    backends = backends_table(rows)
    if backends:
        parts += ["## Attention backends\n\nThe SDPA backend each attention shape ran on, as recorded on the first "
                  "step of each timed row.", backends]
    parts.append(_provenance(rows))
    for suffix, heading, plot in PLOTS:
        png = out_md.with_name(out_md.stem + suffix + ".png")
        if plot(rows, png):
            parts.append(f"## {heading}\n\n![{heading}]({png.name})")
    out_md.write_text("\n\n".join(parts) + "\n")
    return out_md
