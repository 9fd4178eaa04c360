"""A page of one hardware's rows on several software stacks: each model's poros s/step on each stack against its
first stack's, the reference's "no PyTorch-version regression" claim measured on the page's rows; with a reference,
the same ratio of the reference's own stacks beside them, under a heading that names their hardware."""

from __future__ import annotations

import pandas as pd

from poros.engine.method_info import PLANNED
from poros.harness.report.format import DASH, md_table, num, text_or_none
from poros.harness.report.reference import on_hardware
from poros.harness.report.tables import cells_of, ok_value, parity_text, s_step_text

NOTE = ("poros s/step of each model on each stack over its s/step on the first stack ({base}): 1.000× is the same "
        "speed, the reference's \"no PyTorch-version regression\" (its B300 figures: poros speed identical on torch "
        "2.10 and 2.12). Each stack ran in a run of its own: on a shared CPU the load of the moment moves seconds "
        "between runs as much as a stack could (a † marks passes that spread), so a ratio far from 1.000× there says "
        "first that the runs' load differed; the bitwise parity of every stack does not depend on it.")
REFERENCE_NOTE = ("The reference's poros s/step on each of its stacks over its first stack's, from its published "
                  "figures: other models on other hardware, beside this page's for the claim they test.")


def stacks_of(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["stack"]))


def _ratio(a: float | None, b: float | None) -> str:
    return DASH if a is None or not b else f"{a / b:.3f}×"


def across_table(df: pd.DataFrame) -> str:
    """Per model (no sweep point, no plan), a row per stack: the gate's verdict, poros s/step and its ratio to the
    first stack's."""
    stacks = stacks_of(df)
    base = stacks[0]
    cells = cells_of(df)
    rows = []
    for model in dict.fromkeys(m for m, _, point in cells if not point):
        first = ok_value(cells.get((model, base, ""), {}).get(PLANNED), "s_per_step_median")
        for stack in stacks:
            c = cells.get((model, stack, ""))
            if c is None:
                continue
            p = c.get(PLANNED)
            rows.append([model, stack, parity_text(p), s_step_text(p, True),
                         DASH if stack == base else _ratio(ok_value(p, "s_per_step_median"), first)])
    return md_table(["Model", "Stack", "Bitwise parity", "poros s/step (median±std)", "vs first stack"], rows)


def reference_across(ref: pd.DataFrame) -> dict[str, str]:
    """{hardware: table} of the reference rows of each hardware that states several stacks for a model: each row's
    poros s/step and its ratio to the model's first stack's."""
    out = {}
    for hw, g in ref.groupby("hardware", sort=False):
        rows = []
        for model, m in g.groupby("model", sort=False):
            stated = [r for r in m.to_dict("records") if text_or_none(r["stack"])]
            if len(stated) < 2:
                continue
            first = num(stated[0]["poros_s_step_median"])
            for r in stated:
                med, std = num(r["poros_s_step_median"]), num(r["poros_s_step_std"])
                rows.append([model, hw, r["stack"], DASH if med is None else
                             (f"{med:.4f}" if std is None else f"{med:.4f}±{std:.4f}"),
                             DASH if r is stated[0] else _ratio(med, first)])
        if rows:
            out[hw] = md_table(["Model", "Hardware", "Stack", "poros s/step (median±std)", "vs first stack"], rows)
    return out


def across_sections(df: pd.DataFrame, ref: pd.DataFrame | None) -> list[str]:
    """The headings and tables of one hardware's rows across stacks; nothing where they ran on one stack."""
    stacks = stacks_of(df)
    if len(stacks) < 2:
        return []
    parts = ["## Across stacks", NOTE.format(base=stacks[0]), across_table(df)]
    for hw, table in (reference_across(ref) if ref is not None else {}).items():
        where = "this hardware" if on_hardware(hw, df) else "other hardware"
        parts += [f"## The reference across its stacks, on {where} ({hw})", table + f"\n\n{REFERENCE_NOTE}"]
    return parts
