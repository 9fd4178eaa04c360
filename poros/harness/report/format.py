"""Values as a report page shows them: numbers, texts and sizes, a dash for what a row lacks, and the
Markdown table they go into."""

from __future__ import annotations

import math
import re

DASH = "—"
# a code span as CommonMark closes it: a run of backticks, then the same run again (not part of a longer one)
CODE_SPAN = re.compile(r"(`+)(?!`)(.*?[^`])\1(?!`)")


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


def _plain(text: str) -> str:
    """Text outside a code span as it reads: `<`, `>` as entities (else `<c>` is an HTML tag, and hidden), a backtick
    with no partner escaped (else it could pair with a later one)."""
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("`", "\\`")


def md_cell(text: str) -> str:
    """One table cell, whatever it holds (a checkpoint folder's name, a plan's, a sweep value): a newline becomes a
    space (else it ends the row), a literal `|` (as in "max |diff|", or a folder `a|b`) is escaped (else it splits the
    cell; GitHub reads `\\|` as `|` inside a code span too); `<`, `>` and a lone backtick outside code spans are
    escaped (`_plain`). The code spans the pages write on purpose (`cpu`) are kept."""
    text = re.sub(r"\r\n?|\n", " ", text)
    out, at = [], 0
    for span in CODE_SPAN.finditer(text):
        out += [_plain(text[at:span.start()]), span.group(0)]
        at = span.end()
    return ("".join(out) + _plain(text[at:])).replace("|", "\\|")


def md_table(columns, rows) -> str:
    """A Markdown table: every cell, headers too, through `md_cell`, the one place a table's text is escaped."""
    lines = ["| " + " | ".join(map(md_cell, columns)) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(md_cell(c) for c in r) + " |" for r in rows])


def fmt_gb(v: float | None) -> str:
    return DASH if v is None else f"{v:.2f} GB"
