"""docs/settings.md, rendered from the settings table (poros/settings.py): one row per setting with its matrix key,
its flag, its default and what it does, grouped by kind. `poros docs` writes it; a test renders it again and fails
when the committed page is stale."""

from __future__ import annotations

from poros.resolve import has_off_flag
from poros.settings import COMPUTED, RUN, SCHEDULE, SETTINGS, Setting

KIND_HEADINGS = {
    COMPUTED: ("What is computed", "Every method of a cell shares these, and the parity gate compares runs that "
                                   "agree on them: two runs that differ in one compute other bits."),
    SCHEDULE: ("How poros schedules it", "poros's schedule of the same computation: they never change a result "
                                         "bit. A matrix may give them per model (`model_overrides:`) or per plan "
                                         "(`plans:`); most name the method they apply to first."),
    RUN: ("Where and from what", "Recorded with every row, never compared."),
}

INTRO = """# Settings

<!-- Written by `poros docs` from the settings table, poros/settings.py: edit that, not this. -->

Every setting of a run is declared once, in `poros/settings.py`, and that one row gives it everywhere: the flag of
`poros parity`, `poros plan` and `poros train` (`--seq-len 4096`), the key of a matrix file and of a `poros train`
run file (`seq_len: 4096`), the `config` a results row records, and the label of its row in a report's
configuration table. A flag left out takes the default below; `poros train` on a CUDA device takes the defaults its
`--help` names for that device instead, and prints the ones it took. How the mechanisms behind the settings work:
[how-it-works.md](how-it-works.md)."""


def _flag(s: Setting) -> str:
    if not s.cli:
        return "— (matrix key only)"
    if s.is_flag:
        return f"`{s.flag}`" + (f", `--no-{s.flag[2:]}`" if has_off_flag(s.name) else "")
    return f"`{s.flag} {s.metavar or s.name.upper()}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_markdown() -> str:
    """The settings reference, one table per kind of setting, in the table's order."""
    parts = [INTRO]
    for kind, (heading, about) in KIND_HEADINGS.items():
        rows = [f"| `{s.name}` | {_flag(s)} | {_cell(s.default_help or s.show(s.default))} | {_cell(s.help)} |"
                for s in SETTINGS if s.kind == kind]
        parts += [f"## {heading}\n\n{about}",
                  "\n".join(["| setting | flag | default | what it does |", "|---|---|---|---|", *rows])]
    return "\n\n".join(parts) + "\n"
