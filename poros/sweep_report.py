"""Schedule sweeps (scripts/sweep.py rows) as a Markdown page and a plot: per model and gradient
accumulation, resident QLoRA and every poros plan measured in one run on one GPU, each plan gated."""

from __future__ import annotations

import json
from pathlib import Path

from poros.errors import PorosError

DASH = "—"
COLUMNS = ("Model", "Grad-accum", "Method / plan", "Parity (gate)", "s/step", "vs resident", "Tokens/s",
           "Peak VRAM", "Predicted peak", "Host→device per step", "Copy hidden", "Resident layers", "Block")


def load_sweeps(paths) -> list[dict]:
    """Rows of sweep files, in order; a row that failed to plan keeps its error."""
    rows = []
    for path in map(Path, paths):
        if not path.is_file():
            raise PorosError(f"{path}: no such sweep file")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise PorosError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    if not rows:
        raise PorosError("no sweep rows in " + ", ".join(map(str, paths)))
    return rows


def _plan_name(r: dict) -> str:
    if r["method"] != "poros":
        return r["method"]
    parts = []
    budget = r.get("vram_budget")
    parts.append(f"budget {int(budget) / 1e9:g} GB" if budget else "every layer streamed")
    if r.get("offload_inputs"):
        parts.append("inputs in host memory")
    if r.get("cuda_graphs"):
        parts.append("CUDA graphs")
    return "poros, " + ", ".join(parts)


def _gb(v) -> str:
    return DASH if v is None else f"{v:.2f} GB"


def sweep_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    resident = {(r["model"], r.get("grad_accum", 1), r["provenance"]["gpus"][0]["uuid"] if r["provenance"].get("gpus")
                 else "cpu"): r["s_per_step_median"] for r in rows if r["method"] == "resident"}
    for r in rows:
        gpu = r["provenance"]["gpus"][0]["uuid"] if r["provenance"].get("gpus") else "cpu"
        base = resident.get((r["model"], r.get("grad_accum", 1), gpu))
        s = r.get("s_per_step_median")
        if "error" in r:
            cells = [r["model"], str(r.get("grad_accum", 1)), _plan_name(r), "not run: " + r["error"].split(":", 1)[-1]
                     .strip().replace("|", "/")] + [DASH] * (len(COLUMNS) - 4)
        else:
            parity = DASH if r.get("parity") is None else f"{r['parity']} ({r.get('parity_steps')} steps, {r.get('gate')})"
            h2d = r.get("bytes_h2d_per_step")
            hidden = r.get("copy_hidden_share")
            cells = [r["model"], str(r.get("grad_accum", 1)), _plan_name(r), parity,
                     DASH if s is None else f"{s:.4f}", DASH if s is None or not base else f"{s / base:.2f}×",
                     DASH if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.0f}",
                     _gb(r.get("peak_vram_gb")), _gb(r.get("predicted_peak_vram_gb")),
                     DASH if h2d is None else f"{h2d / 1e9:.2f} GB", DASH if hidden is None else f"{hidden * 100:.0f}%",
                     DASH if r.get("resident_layers") is None else str(r["resident_layers"]),
                     DASH if r.get("block_size") is None else str(r["block_size"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _provenance(rows: list[dict]) -> str:
    gpus = sorted({f"{g['name']} (UUID {g['uuid']})" for r in rows for g in r["provenance"].get("gpus") or []})
    commits = sorted({str(r["provenance"].get("git", {}).get("commit")) for r in rows})
    versions = rows[0]["provenance"].get("versions", {})
    return (f"Provenance: commit {', '.join(commits)}; torch {rows[0]['provenance'].get('torch')}, transformers "
            f"{versions.get('transformers')}, bitsandbytes {versions.get('bitsandbytes')}, peft {versions.get('peft')}; "
            f"GPU {', '.join(gpus) or 'none'}. Ratios compare rows of one file and one GPU only.")


def plot_budgets(rows: list[dict], png: Path) -> Path:
    """s/step against the VRAM budget per model (grad_accum 1), resident's s/step and peak as marks."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for model in dict.fromkeys(r["model"] for r in rows):
        pts = sorted((r["peak_vram_gb"], r["s_per_step_median"]) for r in rows
                     if r["model"] == model and r["method"] == "poros" and r.get("grad_accum", 1) == 1
                     and r.get("s_per_step_median") is not None and r.get("peak_vram_gb") is not None)
        if len(pts) < 2:
            continue
        line, = ax.plot(*zip(*pts), marker="o", label=f"{model} poros (peak at each budget)")
        for r in rows:
            if r["model"] == model and r["method"] == "resident" and r.get("grad_accum", 1) == 1:
                ax.scatter([r["peak_vram_gb"]], [r["s_per_step_median"]], marker="*", s=120, color=line.get_color(),
                           label=f"{model} resident QLoRA")
    ax.set(xlabel="peak VRAM (GB, torch max allocated)", ylabel="s/step (median)", title="s/step against VRAM")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return png


def write_sweep_report(paths, out_md, title: str | None = None) -> Path:
    rows = load_sweeps(paths)
    out_md = Path(out_md)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    png = plot_budgets(rows, out_md.with_suffix(".png"))
    parts = [f"# {title or 'Poros — plans measured'}", "Each poros plan first passed the parity gate against resident "
             "QLoRA's states recorded in the same run (torch.equal on every loss, LoRA gradient, weight and AdamW "
             "tensor), then was timed after a discarded warm-up pass. `vs resident` divides by resident's s/step "
             "with the same gradient accumulation on the same GPU.", sweep_table(rows), _provenance(rows),
             f"## s/step against VRAM\n\n![s/step against VRAM]({png.name})"]
    out_md.write_text("\n\n".join(parts) + "\n")
    return out_md
