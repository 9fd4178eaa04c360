"""A matrix that measures a reference's figures again names the reference's hardware (`reference: B300`, as
the reference CSV's `hardware` column writes it) and runs the reference's whole protocol: its steps, passes and
warm-up, its settings (sequence length, batch, accumulation, LoRA rank and alpha, poros's block size), dataset and
precision, the stacks its rows state (torch with its build, transformers, bitsandbytes), and each method on the
attention path the reference measured it on. The CSV's `attention_note` says that path per method, in clauses such
as `poros math-only SDPA; baselines default flash`; `reference_problems` holds a matrix to all of it, one line
per difference."""

from __future__ import annotations

from poros.config import Attention, Method
from poros.engine.method_info import INFO, by_value
from poros.harness.report.format import num, text_or_none
from poros.harness.report.rows import OFFICIAL_REFERENCE, load_reference
from poros.harness.stacks import stack_id

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


# The protocol columns of a reference CSV, in the order problems are listed: the run's repetitions, then the settings
# every cell computes with (poros's block size: its cells'), then what the rows ran on.
RUN_FIELDS = ("steps", "passes", "warmup_passes", "warmup_pass_steps")
SETTING_FIELDS = ("seq_len", "batch_size", "grad_accum", "lora_rank", "lora_alpha", "block_size")
DATA_FIELDS = ("dataset", "precision")
PROTOCOL = RUN_FIELDS + SETTING_FIELDS + DATA_FIELDS


def _value(v):
    """A CSV cell as the matrix writes it: 200 for 200.0, text as it is, None for an empty cell."""
    n = num(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    if n is not None:
        return int(n) if n == int(n) else n
    return None if isinstance(v, (int, float)) else text_or_none(v)


def _shown(values) -> str:
    return " and ".join(str(v) for v in values)


def matrix_protocol(m) -> dict[str, list]:
    """What a matrix runs of each protocol field: every distinct value its cells take (a sweep point, a method's or a
    plan's setting may change one; block_size is poros's cells'). A warm-up pass the matrix does not size is as long
    as a timed one (`steps`, held on its own): its length is [] then, and without warm-up."""
    sized = m.warmup_passes and m.warmup_pass_steps is not None
    out: dict[str, list] = {"steps": [m.steps], "passes": [m.passes], "warmup_passes": [m.warmup_passes],
                            "warmup_pass_steps": [m.warmup_pass_steps] if sized else [],
                            "dataset": [m.dataset], "precision": [m.precision]}
    for k in SETTING_FIELDS:
        methods = [Method.POROS] if k == "block_size" and Method.POROS in m.methods else list(m.methods)
        plans = m.plan_names()
        out[k] = list(dict.fromkeys(m.settings_for(model, point, meth, plan if meth is Method.POROS else None)[k]
                                    for model in m.models for point in m.points() for meth in methods for plan in plans))
    return out


def _stack_text(stack: str, bnb) -> str:
    return f"{stack}, bitsandbytes {bnb}" if text_or_none(bnb) else stack


def stack_problems(m, rows) -> list[str]:
    """Where the stacks a matrix pins are not the ones the reference's rows state (torch's version and build,
    transformers', bitsandbytes'): one problem; none where the rows state no stack."""
    stated = {}
    for r in rows:
        found = stack_id(r["stack"])
        if found is not None:
            stated[(found, text_or_none(r.get("bitsandbytes")))] = _stack_text(r["stack"], r.get("bitsandbytes"))
    if not stated:
        return []
    pinned = {}
    for st in m.stacks:
        label = "current (the installed stack)" if st.is_current else f"torch {st.torch} / transformers {st.transformers}"
        key = (None if st.is_current else stack_id(label), st.bitsandbytes)
        pinned[key] = label if st.is_current else _stack_text(label, st.bitsandbytes)
    if set(pinned) == set(stated):
        return []
    return [f"reference {m.reference}: stacks: its figures ran {_shown(stated.values())}; this matrix pins "
            f"{_shown(pinned.values())}"]


def protocol_problems(m, rows) -> list[str]:
    """Each protocol field (`PROTOCOL`) in which a matrix differs from the reference rows of its hardware, one line
    each, as `reference B300: steps: its figures ran 200, this matrix 50`; a field the rows leave empty is not
    stated, and rows that state it twice are named."""
    have, problems = matrix_protocol(m), []
    for k in PROTOCOL:
        if not have[k]:
            continue  # a warm-up pass of the timed passes' length (steps says it), or none (warmup_passes says it)
        stated = list(dict.fromkeys(v for v in (_value(r.get(k)) for r in rows) if v is not None))
        if len(stated) > 1:
            problems.append(f"reference {m.reference}: {k}: its rows state {_shown(stated)}; give one")
        elif stated and have[k] != stated:
            problems.append(f"reference {m.reference}: {k}: its figures ran {stated[0]}, this matrix {_shown(have[k])}")
    return problems + stack_problems(m, rows)


def reference_problems(m, csv_path=OFFICIAL_REFERENCE) -> list[str]:
    """Where a matrix that names a reference does not run the reference's protocol ([] without a `reference:` key):
    each field that differs (`protocol_problems`), the stacks, and one problem naming every method that runs on
    another attention path than the reference's note says."""
    if m.reference is None:
        return []
    ref = load_reference(csv_path)
    if "attention_note" not in ref.columns:
        return [f"reference: {csv_path} has no attention_note column to hold the matrix's attention to"]
    rows = [r for r in ref.to_dict("records") if r["hardware"] == m.reference]
    notes = list(dict.fromkeys(r["attention_note"] for r in rows))
    if not notes:
        known = ", ".join(dict.fromkeys(map(str, ref["hardware"])))
        return [f"reference: {csv_path} has no rows of hardware {m.reference!r} (it has {known})"]
    have = matrix_attention(m)
    problems = protocol_problems(m, rows)
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
