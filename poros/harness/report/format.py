"""Values as a report page shows them: numbers, texts and sizes, a dash for what a row lacks, and the
Markdown table they go into."""

from __future__ import annotations

import math

DASH = "—"


def num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def text_or_none(v) -> str | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) or v == "" else str(v)


def uniq(values, sep: str = ", ") -> str:
    out = list(dict.fromkeys(str(v) for v in values if text_or_none(v) is not None))
    return sep.join(out) if out else DASH


def counted(n, unit: str) -> str:
    """`n` and its unit, singular for one: "1 step", "3 passes"."""
    n = int(n)
    return f"{n} {unit}" if n == 1 else f"{n} {unit}es" if unit.endswith("s") else f"{n} {unit}s"


def steps_by_passes(steps, passes) -> str:
    return f"{counted(steps, 'step')} × {counted(passes, 'pass')}"


def md_table(columns, rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    # A literal "|" (as in "max |diff|") would split the Markdown cell.
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows])


def fmt_gb(v: float | None) -> str:
    return DASH if v is None else f"{v:.2f} GB"
