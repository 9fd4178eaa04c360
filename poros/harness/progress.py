"""Where a run in parts stands (`poros bench status`): per cell, done, passes so far or not started; per
part (one `poros bench matrix ... --resume --max-minutes` run), when it ran, on which GPU, and what it spent
on timed passes and outside them. Read from the output folder's rows and pass log alone."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from poros.harness.cells import matrix_cells
from poros.harness.matrix import Matrix
from poros.harness.report.format import counted
from poros.harness.report.rows import row_gpus
from poros.harness.results import PassLog, ResultsWriter, passes_path, row_key

TIMED = "timed passes"


def _when(ts: float | None) -> str:
    return "—" if ts is None else dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M")


def _short(uuid: str) -> str:
    """A GPU as the pages name it: its UUID's first 8 hex digits."""
    return uuid.removeprefix("GPU-")[:8]


def _exit(part: dict) -> str:
    status = part.get("exit_status")
    return "— (no end: lost or running)" if status is None else str(status)


def cell_states(m: Matrix, out: Path) -> list[tuple[str, str]]:
    """(cell, state) for every cell of `m` in matrix order: a gate's outcome, a timed cell's s/step, the passes
    kept so far, or `not started`."""
    rows = {row_key(r): r for r in ResultsWriter(out / "results.jsonl").rows() if r.get("matrix") == m.name}
    records = PassLog(passes_path(out / "results.jsonl")).records()
    passes: dict[str, dict[int, dict]] = {}
    gates: dict[str, dict] = {}
    for r in records:
        if r.get("kind") == "pass":
            passes.setdefault(r["cell"], {})[r["index"]] = r
        elif r.get("kind") == "gate":
            gates[r["cell"].rsplit("/", 1)[0]] = r.get("result") or {}
    states = []
    for cell in matrix_cells(m):
        name = f"{cell.model} " + (cell.method.value if cell.method else "gate") + (f" {cell.plan}" if cell.plan else "")
        row = rows.get(cell.key)
        if cell.method is None:
            g = gates.get(cell.id)
            steps = "" if g is None or g.get("steps") is None else f" ({counted(g['steps'], 'step')})"
            states.append((name, "not run" if g is None else f"{g.get('parity')}{steps}"))
        elif row is not None and row.get("status") == "ok":
            gpus = sorted(row_gpus(row) - {"cpu"})
            on = f" on {', '.join(_short(g) for g in gpus)}" if gpus else ""
            states.append((name, f"done: {row['s_per_step_median']:.4f} s/step over {len(row['per_pass_s'])} passes{on}"
                           if row.get("s_per_step_median") is not None else "done (not timed)"))
        elif row is not None:
            states.append((name, f"{row.get('status')}: {str(row.get('error'))[:80]}"))
        elif passes.get(cell.id):
            states.append((name, f"{len(passes[cell.id])} of {m.passes} passes"))
        else:
            states.append((name, "not started"))
    return states


def timed_gpus(m: Matrix, out: Path) -> list[str]:
    """Every GPU the finished timed cells of `m` ran their passes on, by UUID."""
    rows = [r for r in ResultsWriter(out / "results.jsonl").rows() if r.get("matrix") == m.name]
    return sorted(set().union(*(row_gpus(r) for r in rows if r.get("status") == "ok")) - {"cpu"})


def parts(out: Path) -> list[dict]:
    """The parts recorded in the output folder's pass log, oldest first, each as its last record: a part is
    recorded when its first cell runs, after each cell and at its end, under one `part_id` (a record without
    one, of an earlier harness, is a part of its own). A part whose last record has no `exit_status` did not
    reach its end: its machine or process was lost (or it runs still)."""
    last: dict = {}
    for i, r in enumerate(PassLog(passes_path(out / "results.jsonl")).records()):
        if r.get("kind") == "part":
            last[r.get("part_id") or i] = r  # an update keeps the part's place
    return list(last.values())


def status_markdown(m: Matrix, out: Path) -> str:
    """Markdown: the cells' states and the parts' times."""
    states = cell_states(m, out)
    timed = [s for n, s in states if not n.endswith(" gate")]
    done = sum(s.startswith("done") for s in timed)
    lines = [f"{done} of {len(timed)} timed cells done ({counted(m.steps, 'step')} x {counted(m.passes, 'pass')} each).", "",
             "| cell | state |", "|---|---|"]
    lines += [f"| {n} | {s} |" for n, s in states]
    gpus = timed_gpus(m, out)
    if len(gpus) > 1:
        lines += ["", f"The timed cells ran on {len(gpus)} GPUs ({', '.join(_short(g) for g in gpus)}): a ratio between "
                      "cells of different GPUs compares machines as well as methods (the page marks it †)."]
    recorded = parts(out)
    if recorded:
        lines += ["", "| part | started (UTC) | wall | timed passes | outside timed passes | exit | GPU |",
                  "|---|---|---|---|---|---|---|"]
        for i, p in enumerate(recorded, 1):
            phases = p.get("phases") or {}
            rest = ", ".join(f"{k} {v:.0f} s" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]) if k != TIMED)
            gpu = ", ".join(_short(g) for g in p.get("gpu") or []) or "—"
            lines.append(f"| {i} | {_when(p.get('started'))} | {p.get('wall_s', 0):.0f} s | {phases.get(TIMED, 0):.0f} s "
                         f"| {rest or '—'} | {_exit(p)} | {gpu} |")
        total = sum(p.get("wall_s", 0) for p in recorded)
        timed_s = sum((p.get("phases") or {}).get(TIMED, 0) for p in recorded)
        lines += ["", f"{len(recorded)} parts, {total:.0f} s in all, {timed_s:.0f} s of it in timed passes "
                      f"({timed_s / total:.0%})." if total else ""]
    return "\n".join(lines).rstrip() + "\n"
