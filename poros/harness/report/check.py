"""A run's page against a committed page of the same matrix (`poros report RUN -o PAGE --check-against ROWS`): CI
renders the CPU page from its own run and holds it to the committed one. What the page says was run must match
exactly, cell by cell: the protocol (steps, passes, warm-up, every setting of the configuration table, the stack with
its bitsandbytes and peft) and the parity gate's verdict and largest difference. Timings vary on a shared machine,
so a slowdown (poros s/step over resident's) outside `RATIO_BAND` of the committed one is a warning, not a failure."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from poros.engine.method_info import PLANNED, REFERENCES
from poros.harness.report.format import num, text_or_none
from poros.harness.report.rows import latest, point_label, setting_shown
from poros.settings import COMPUTED, SCHEDULE, SETTINGS

RATIO_BAND = 0.25  # a run's slowdown within ±25% of the committed one's passes quietly
RUN_FIELDS = ("status", "steps", "passes", "warmup_passes", "warmup_pass_steps", "reduced")
VERSIONS = ("bitsandbytes", "peft")  # beside the stack label's torch (with its build) and transformers


@dataclass
class Check:
    """What a check found: `problems` fail it (each names its cell), `warnings` do not; `cells` were compared."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    cells: int = 0


def cell_name(row) -> str:
    """A cell as the check names it: `tiny-qwen2 poros`, with its plan and sweep point where it has them."""
    extra = ", ".join(x for x in (row.get("point") or "", text_or_none(row.get("plan_name")) and
                                  f"plan {row['plan_name']}") if x)
    return f"{row['model']} {row['method']}" + (f" ({extra})" if extra else "")


def protocol(row) -> dict[str, str]:
    """What a row says was run, as the page shows it: its repetitions and warm-up, each setting of the configuration
    table (a setting the row predates reads as its default, a warm-up pass it does not size is `steps` long), its
    stack and the versions beside it."""
    config = row["config"]
    versions = row["provenance"].get("versions") or {}
    out = {k: str(row.get(k)) for k in RUN_FIELDS}
    # a warm-up pass as long as the timed ones reads `steps` (rows that predate the field warmed up so), whatever
    # `steps` is: a run of other steps differs in `steps` alone
    warm = row.get("warmup_pass_steps")
    out["warmup_pass_steps"] = "steps" if warm is None or warm == row["steps"] else str(warm)
    out.update({s.name: setting_shown(s, config) for s in SETTINGS if s.kind in (COMPUTED, SCHEDULE)})
    out.update(stack=str(row["stack"]), **{k: str(versions.get(k)) for k in VERSIONS},
               dataset=str(config.get("dataset")), precision=str(config.get("precision")))
    return out


def parity(row) -> str:
    diff = num(row.get("parity_max_abs_diff"))
    return f"{text_or_none(row.get('parity')) or 'not gated'}" + ("" if diff is None else f" ({diff:.2e})")


def _by_cell(df: pd.DataFrame) -> dict[tuple, dict]:
    """The latest row of each cell by (model, method, sweep point, plan): a setting that differs (seq_len among them)
    is the protocol's to name, not another cell."""
    out = {}
    for r in latest(df).to_dict("records"):
        r["point"] = point_label(r.get("sweep"))
        out[(r["model"], r["method"], r["point"], r.get("plan_key") or "")] = r
    return out


def _slowdowns(cells: dict[tuple, dict]) -> dict[tuple, float]:
    """{(model, point, plan): poros s/step over resident s/step} of the cells both methods timed."""
    out = {}
    for (model, method, point, plan), r in cells.items():
        base = cells.get((model, REFERENCES[0], point, ""))
        mine, theirs = (num(x["s_per_step_median"]) if x and x["status"] == "ok" else None for x in (r, base))
        if method == PLANNED and mine and theirs:
            out[(model, point, plan)] = mine / theirs
    return out


def check_against(run: pd.DataFrame, committed: pd.DataFrame, band: float = RATIO_BAND) -> Check:
    """Hold a run's rows to the committed rows of its page: every committed cell is run, no other; each cell's protocol
    and parity equal; slowdowns outside `band` (a share: 0.25 is ±25%) of the committed ones are warnings."""
    got, want, out = _by_cell(run), _by_cell(committed), Check()
    for key in sorted(set(want) - set(got)):
        out.problems.append(f"{cell_name(want[key])}: on the committed page, not in this run")
    for key in sorted(set(got) - set(want)):
        out.problems.append(f"{cell_name(got[key])}: in this run, not on the committed page")
    for key in [k for k in want if k in got]:
        out.cells += 1
        r, c = got[key], want[key]
        mine, theirs = protocol(r), protocol(c)
        for k in theirs:
            if k == "warmup_pass_steps" and "0" in (mine["warmup_passes"], theirs["warmup_passes"]):
                continue  # no warm-up on one side: warmup_passes names it
            if mine[k] != theirs[k]:
                out.problems.append(f"{cell_name(c)}: {k} {mine[k]} in this run, {theirs[k]} on the committed page")
        if parity(r) != parity(c):
            out.problems.append(f"{cell_name(c)}: parity {parity(r)} in this run, {parity(c)} on the committed page")
    ours, theirs = _slowdowns(got), _slowdowns(want)
    for key in [k for k in theirs if k in ours]:
        change = ours[key] / theirs[key] - 1
        if abs(change) > band:
            model, point, plan = key
            what = cell_name({"model": model, "method": PLANNED, "point": point, "plan_name": plan or None})
            out.warnings.append(f"{what}: slowdown vs {REFERENCES[0]} {ours[key]:.2f}× in this run, {theirs[key]:.2f}× "
                                f"on the committed page ({change:+.0%}, outside ±{band:.0%})")
    return out
