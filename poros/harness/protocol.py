"""A matrix that measures a reference's figures again names the reference's hardware (`reference: B300`, as
the reference CSV's `hardware` column writes it) and runs each method on the attention path the reference
measured it on. The CSV's `attention_note` says that path per method, in clauses such as
`poros math-only SDPA; baselines default flash`; `reference_problems` holds a matrix to it."""

from __future__ import annotations

from poros.config import Attention, Method
from poros.engine.method_info import INFO, by_value
from poros.harness.report.rows import OFFICIAL_REFERENCE, load_reference

# how a note names an attention path, and the setting that runs it
PATHS = {"math-only SDPA": Attention.MATH, "default flash": Attention.FLASH, "default fast path": Attention.DEFAULT}
ALL, BASELINES = "all methods", "baselines"  # every method; every method but the planned one (poros)


def note_attention(note: str) -> dict[Method, Attention]:
    """The attention path of each method a note names, e.g. {poros: math, resident: flash, ...}.

    Raises:
        ValueError: a clause names no known path or subject, or a method twice.
    """
    out: dict[Method, Attention] = {}
    for clause in (c.strip() for c in str(note).split(";")):
        path = next((p for p in PATHS if clause.endswith(f" {p}")), None)
        subject = clause[: -len(path)].strip() if path else ""
        if path is None:
            raise ValueError(f"attention note {note!r}: {clause!r} names no attention path of {', '.join(PATHS)}")
        if subject == ALL:
            methods = list(INFO)
        elif subject == BASELINES:
            methods = [m for m, i in INFO.items() if not i.planned]
        elif by_value(subject) is not None:
            methods = [Method(subject)]
        else:
            raise ValueError(f"attention note {note!r}: {subject!r} is neither {ALL!r}, {BASELINES!r} nor a method")
        twice = [m.value for m in methods if m in out]
        if twice:
            raise ValueError(f"attention note {note!r}: names the path of {', '.join(twice)} twice")
        out.update(dict.fromkeys(methods, PATHS[path]))
    return out


def _paths(attention: dict) -> str:
    return ", ".join(f"{m.value} on {a.value if isinstance(a, Attention) else a}" for m, a in attention.items())


def matrix_attention(m) -> dict[Method, str]:
    """The attention setting each method of a matrix runs its timed cells with (its sweep points' values
    joined by ` and `)."""
    def value(a) -> str:
        return a.value if isinstance(a, Attention) else str(a)

    return {meth: " and ".join(dict.fromkeys(value(m.settings_for(m.models[0], point, meth)["attention"])
                                             for point in m.points())) for meth in m.methods}


def reference_problems(m, csv_path=OFFICIAL_REFERENCE) -> list[str]:
    """Where a matrix that names a reference runs a method on another attention path than the reference's
    note says: one problem naming every method that differs ([] without a `reference:` key)."""
    if m.reference is None:
        return []
    ref = load_reference(csv_path)
    if "attention_note" not in ref.columns:
        return [f"reference: {csv_path} has no attention_note column to hold the matrix's attention to"]
    notes = list(dict.fromkeys(n for h, n in zip(ref["hardware"], ref["attention_note"]) if h == m.reference))
    if not notes:
        known = ", ".join(dict.fromkeys(map(str, ref["hardware"])))
        return [f"reference: {csv_path} has no rows of hardware {m.reference!r} (it has {known})"]
    have = matrix_attention(m)
    problems = []
    for note in notes:
        try:
            want = note_attention(note)
        except ValueError as e:
            problems.append(f"reference {m.reference}: {e}")
            continue
        wrong = {meth: a for meth, a in have.items() if meth in want and a != want[meth].value}
        if wrong:
            problems.append(f"reference {m.reference}: its figures ran {_paths({k: want[k] for k in have if k in want})}"
                            f" (attention note {note!r}); this matrix runs {_paths(wrong)}: set attention per "
                            f"method under method_settings")
    return problems
