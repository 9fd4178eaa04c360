"""A matrix page beside reference figures (reports/reference/official.csv): a reference row is the same cell as a
measured one only where both ran on the same hardware (the reference's label, as `B300` or `A100-80GB-PCIe`,
matched against the name the rows' GPU gives, as `NVIDIA A100 80GB PCIe`: `poros.provenance.is_hardware`) and the
same stack (torch's version and CUDA build and transformers' version: `poros.harness.stacks.same_stack`). Rows of
other hardware stand apart, under a heading that says so, for their ratios."""

from __future__ import annotations

import pandas as pd

from poros.engine.method_info import PLANNED, REFERENCES, UNGATED
from poros.harness.report.format import DASH, fmt_gb, md_table, num, text_or_none, uniq
from poros.harness.report.tables import cells_of, ok_value, s_step_text
from poros.harness.stacks import same_stack
from poros.provenance import is_hardware

NO_MODEL = "No model is present in both the reference and the results."


def ran_on(label: str, row) -> bool:
    """Whether a row ran on the hardware a reference names `label`: its page's hardware name, or the name of a
    GPU it ran on, is that hardware (a row run on the CPU is the CPU's only, whatever GPUs the machine has)."""
    names = [row["hardware"]]
    if (row["config"].get("device") or "cuda") != "cpu":
        names += [g.get("name") or "" for g in row["provenance"].get("gpus") or []]
    return any(is_hardware(label, n) for n in names if n)


def on_hardware(label, df: pd.DataFrame) -> bool:
    """Whether every row of `df` ran on the hardware `label` names (False for a label that is empty)."""
    label = text_or_none(label)
    return label is not None and all(ran_on(label, r) for r in df.to_dict("records"))


def measured_models(df: pd.DataFrame) -> set[str]:
    return {str(m).lower() for m in df["model"]}


def of_models(ref: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """The reference rows of the models `df` measured (with the reference's source)."""
    out = ref[[str(m).lower() in measured_models(df) for m in ref["model"]]].copy()
    out.attrs = dict(ref.attrs)
    return out


def reference_table(df: pd.DataFrame, ref: pd.DataFrame) -> str:
    """Each reference row of this hardware whose model was measured, beside the cells measured on the reference
    row's stack (`same_stack`); — where none was. `ref` holds only rows of the hardware `df` ran on."""
    cells, rows = cells_of(df), []
    baseline = REFERENCES[0]
    for r in of_models(ref, df).to_dict("records"):
        c = next((c for (m, s, _), c in cells.items()
                  if m.lower() == str(r["model"]).lower() and same_stack(s, r["stack"])), {})
        med, std = num(r["poros_s_step_median"]), num(r["poros_s_step_std"])
        ref_poros = DASH if med is None else (f"{med:.4f}" if std is None else f"{med:.4f}±{std:.4f}")
        ref_res = num(r["resident_s_step"])
        rows.append([r["model"], text_or_none(r["hardware"]) or DASH, text_or_none(r["stack"]) or DASH,
                     ref_poros, s_step_text(c.get(PLANNED), True),
                     DASH if ref_res is None else f"{ref_res:.4f}", s_step_text(c.get(baseline), True),
                     fmt_gb(num(r["poros_vram_gb"])), fmt_gb(ok_value(c.get(PLANNED), "peak_vram_gb")),
                     fmt_gb(num(r["resident_vram_gb"])), fmt_gb(ok_value(c.get(baseline), "peak_vram_gb"))])
    cols = ("Model", "Reference hardware", "Reference stack", "ref poros s/step", "measured poros s/step",
            "ref resident s/step", "measured resident s/step", "ref poros VRAM", "measured poros VRAM",
            "ref resident VRAM", "measured resident VRAM")
    if not rows:
        return NO_MODEL
    source = f"Reference figures: {ref.attrs['source']}. " if ref.attrs.get("source") else ""
    measured = uniq(df["stack"], " and ")
    return md_table(cols, rows) + (f"\n\n{source}Measured cells stand beside a reference row only where they ran "
                                   f"on its hardware and its stack (torch's version and CUDA build, and transformers' "
                                   f"version); — where none did (measured here: {measured}).")


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


def hardware_table(df: pd.DataFrame, ref: pd.DataFrame, note: str) -> str:
    """Per model, this page's figures beside every reference row of the model in `ref`, each named with its
    hardware, stack and attention paths: the ratios (poros against resident and Unsloth, VRAM cut) compare across
    hardware where seconds do not. No row is paired with another: each stands for its own run."""
    others = [REFERENCES[0], *UNGATED]
    columns = ["Model", "Hardware", "Stack", "Attention", "poros s/step", *(f"{m} s/step" for m in others),
               *(f"{'Slowdown ' if i == 0 else ''}vs {m}" for i, m in enumerate(others)), "poros VRAM",
               *(f"{m} VRAM" for m in others), *(f"{'VRAM cut ' if i == 0 else ''}vs {m}" for i, m in enumerate(others))]
    hw = uniq(df["hardware"]) if "hardware" in df else DASH
    rows = []
    for (model, stack, point), c in cells_of(df).items():
        if point:
            continue
        p = c.get(PLANNED)
        o = [c.get(m) for m in others]
        ps, pv = ok_value(p, "s_per_step_median"), ok_value(p, "peak_vram_gb")
        os_, ov = [ok_value(x, "s_per_step_median") for x in o], [ok_value(x, "peak_vram_gb") for x in o]
        rows.append([model, f"{hw} (this page)", stack, attention_text({m: c.get(m) for m in (PLANNED, *others)}),
                     s_step_text(p, True), *(s_step_text(x) for x in o), *(_ratio(ps, s) for s in os_), fmt_gb(pv),
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
        return NO_MODEL
    source = f"Reference figures: {ref.attrs['source']}. " if ref.attrs.get("source") else ""
    return md_table(columns, rows) + (f"\n\n{source}{note} The reference rows' ratios are computed from its published "
                                      f"(rounded) figures: a last digit may differ from its own table's.")


OTHER_NOTE = ("These reference rows ran on other hardware than this page's: none is the same cell as a row of this "
              "page. Each row is one run on its own hardware and stack; compare the ratios and the VRAM across rows, "
              "not the seconds.")
SAME_NOTE = ("These reference rows ran on this page's hardware; each is the same cell as a measured one only where "
             "that ran on its stack too (the table below). Each row is one run on its own stack.")


def reference_sections(df: pd.DataFrame, ref: pd.DataFrame) -> list[str]:
    """The headings and tables of one hardware's rows (`df`) beside the reference: its rows of this hardware side by
    side and, where a cell ran on a row's stack too, paired; its rows of other hardware under a heading of their own.
    Nothing where the reference lists none of the models measured."""
    mine = of_models(ref, df)
    if mine.empty:
        return []
    same = mine[[on_hardware(h, df) for h in mine["hardware"]]].copy()
    other = mine.drop(same.index)
    same.attrs, other.attrs = dict(mine.attrs), dict(mine.attrs)
    parts = []
    if not same.empty:
        parts += [f"## The reference on this hardware ({uniq(same['hardware'])})", hardware_table(df, same, SAME_NOTE)]
        paired = reference_table(df, same)
        if any(line.count(DASH) < 4 for line in paired.splitlines()[2:] if line.startswith("|")):
            parts += ["## Reference vs measured, same hardware and stack", paired]
    if not other.empty:
        parts += [f"## The reference on other hardware ({uniq(other['hardware'])})",
                  hardware_table(df, other, OTHER_NOTE)]
    return parts
