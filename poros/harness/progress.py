"""Where a run in parts stands (`poros bench status`): per cell, done, failed, passes so far, not started or unable to
run on the matrix's device; per part (one `poros bench matrix ... --resume --max-minutes` run), when it ran, on which
GPU, and what it spent on timed passes and outside them. Read from the output folder's rows and pass log alone, each
record held to this matrix as `--resume` holds it: a row or pass record of other settings, another matrix, or an
index past the cell's passes counts for nothing here either."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from poros.config import Method
from poros.engine.methods.registry import config_for, gate_of, method_unavailable
from poros.errors import PorosError
from poros.harness.cells import (cell_config, cell_fingerprint, gate_config, gate_fingerprint, matrix_cells,
                                 matrix_device, model_unavailable, reference_fingerprint)
from poros.harness.matrix import Matrix
from poros.harness.report.format import counted
from poros.harness.report.rows import row_gpus
from poros.harness.results import PassLog, ResultsWriter, passes_path, row_key
from poros.settings import COMPUTED_NAMES, SCHEDULE_NAMES

TIMED = "timed passes"


def _when(ts: float | None) -> str:
    return "—" if ts is None else dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M")


def _short(uuid: str) -> str:
    """A GPU as the pages name it: its UUID's first 8 hex digits."""
    return uuid.removeprefix("GPU-")[:8]


def _exit(part: dict) -> str:
    status = part.get("exit_status")
    return "— (no end: lost or running)" if status is None else str(status)


def run_counts(m: Matrix, out: Path) -> Matrix:
    """`m` with the steps and passes its run in `out` measured (a reduced run's `--steps`/`--passes`), as its latest
    part record names them; `m` itself where no part names them."""
    named = [p for p in parts(out) if p.get("steps") is not None]
    return m.with_overrides(named[-1]["steps"], named[-1]["passes"]) if named else m


def settings_differ(m: Matrix, cell, row: dict) -> str | None:
    """How a results row of `cell` differs from what this matrix measures in it (steps and passes, each computed
    setting, poros's schedule; None where it does not): a row of another run in the same cell's place."""
    if (row.get("steps"), row.get("passes")) != (m.steps, m.passes):
        return f"{row.get('steps')} steps x {row.get('passes')} passes, the matrix {m.steps} x {m.passes}"
    want = json.loads(json.dumps(config_for(cell.method, cell_config(m, cell)).as_dict()))
    names = COMPUTED_NAMES + (SCHEDULE_NAMES if cell.method is Method.POROS else ())
    have = row.get("config") if isinstance(row.get("config"), dict) else {}
    changed = [f"{k} {have[k]!r}, the matrix {want.get(k)!r}" for k in names if k in have and have[k] != want.get(k)]
    return "; ".join(changed) or None


class Folder:
    """A run's output folder read for matrix `m`: its rows and pass log, held to `m`."""

    def __init__(self, m: Matrix, out: Path):
        self.m, self.out = m, out
        results = out / "results.jsonl"
        rows = ResultsWriter(results).rows()
        other = sorted({str(r.get("matrix")) for r in rows} - {m.name})
        if other:
            raise PorosError(f"{results} holds rows of matrix {', '.join(map(repr, other))}, not {m.name!r}: pass the "
                             f"matrix file that run measured")
        self.rows = {row_key(r): r for r in rows}  # each cell's latest row
        self.log = PassLog(passes_path(results))
        self.records = self.log.records()
        self.device = matrix_device(m)
        self.notes: list[str] = []  # records left out, said below the table

    def passes(self, cell) -> list[dict]:
        fp = cell_fingerprint(self.m, cell)
        self.notes += self.log.ignored_passes(cell.id, fp, self.m.passes)
        return self.log.passes(cell.id, fp, self.m.passes)

    def row(self, cell) -> tuple[dict | None, str | None]:
        """`cell`'s latest row and how it differs from this matrix's cell (None where it does not)."""
        row = self.rows.get(cell.key)
        return row, None if row is None else settings_differ(self.m, cell, row)

    def cannot_run(self, cell) -> str | None:
        """Why `cell` can never run on the matrix's device (a method or model the device cannot take); a GPU
        matrix's cells are not judged by this machine."""
        why = cell.stack.mismatch() if self.device == "cpu" else None
        why = why or model_unavailable(cell.model, self.device)
        if not why and cell.method is not None and self.device != "cuda":
            why = method_unavailable(cell.method, self.device)
        return why

    def gate_state(self, cell) -> str:
        """A gate's outcome: the pass log's (every plan's), else its members' rows', else its reference's side kept,
        else not run."""
        m = self.m
        pair = gate_of(m.methods)
        plans = m.plan_names() if pair and pair[1] is Method.POROS else [None]
        outcomes = [self.log.gate(cell.id + f"/{plan}", gate_fingerprint(m, cell, plan, m.parity_steps))
                    for plan in plans]
        if any(outcomes):
            ran = [o for o in outcomes if o]
            failed = [(p, o) for p, o in zip(plans, outcomes) if o and o["parity"] != "PASS"]
            if failed:
                plan, o = failed[0]
                where = "" if plan is None else f"plan {plan}: "
                return f"{where}FAIL (first mismatch {o.get('first_mismatch')}): --resume gates it again"
            left = len(outcomes) - len(ran)
            return f"PASS ({counted(ran[0]['steps'], 'step')})" + (f"; {left} plan(s) not gated yet" if left else "")
        members = [c for c in matrix_cells(m) if c.gate_key == cell.gate_key and pair and c.method in pair]
        rows = [r for r, differ in map(self.row, members) if r is not None and not differ and r.get("parity")]
        if rows:
            fail = next((r for r in rows if r["parity"] == "FAIL"), None)
            if fail is not None:
                return f"FAIL (first mismatch {fail.get('parity_first_mismatch')}): --resume gates it again"
            steps = rows[0].get("parity_steps")
            return "PASS" + ("" if steps is None else f" ({counted(steps, 'step')})")
        if pair is not None:
            reference, method = pair
            cfg = gate_config(m, cell, plans[0])
            kept = self.log.reference(cell.id + "/reference", reference_fingerprint(m, cfg, m.parity_steps, reference))
            if kept is not None:
                return (f"{reference.value}'s side kept ({kept.get('seconds') or 0:.0f} s, {kept.get('file')}); "
                        f"{method.value}'s side not run yet")
        why = self.cannot_run(cell)
        return f"cannot run on {self.device}: {why}" if why else "not run"

    def cell_state(self, cell) -> tuple[str, list[dict]]:
        """A timed cell's state and the passes it has (the pass log's, held to the cell)."""
        row, differ = self.row(cell)
        passes = self.passes(cell)
        if row is not None and differ:
            return f"rows of other settings ({differ}): not this matrix's cell", passes
        if row is not None and row.get("status") == "ok" and row.get("parity") == "FAIL":
            return (f"parity FAIL (first mismatch {row.get('parity_first_mismatch')}): not done; --resume gates it "
                    f"again"), passes
        if row is not None and row.get("status") == "ok":
            if row.get("s_per_step_median") is None:
                return "done (not timed)", passes
            gpus = sorted(self.cell_gpus(row, passes))
            on = f" on {', '.join(_short(g) for g in gpus)}" if gpus else ""
            return f"done: {row['s_per_step_median']:.4f} s/step over {len(row.get('per_pass_s') or [])} passes{on}", passes
        if row is not None:
            return f"{row.get('status')}: {str(row.get('error'))[:80]}", passes
        if passes:
            gpus = sorted({p["gpu"] for p in passes if p.get("gpu")})
            on = f" on {', '.join(_short(g) for g in gpus)}" if gpus else ""
            return f"{len(passes)} of {self.m.passes} passes{on}", passes
        why = self.cannot_run(cell)
        return (f"cannot run on {self.device}: {why}" if why else "not started"), passes

    @staticmethod
    def cell_gpus(row: dict | None, passes: list[dict]) -> set[str]:
        """The GPUs a cell's passes ran on: as its pass records name them, else as its row does (records of an
        earlier harness name none)."""
        named = {p["gpu"] for p in passes if p.get("gpu")}
        if named or row is None:
            return named
        return row_gpus(row) - {"cpu"}


def _name(cell) -> str:
    return f"{cell.model} " + (cell.method.value if cell.method else "gate") + (f" {cell.plan}" if cell.plan else "")


def cell_states(m: Matrix, out: Path) -> list[tuple[str, str]]:
    """(cell, state) for every cell of `m` in matrix order: a gate's outcome, a timed cell's s/step, the passes
    kept so far, why it cannot run on the matrix's device, or `not started`."""
    return _read(m, out)[0]


def _read(m: Matrix, out: Path) -> tuple[list[tuple[str, str]], set[str], set, list[str]]:
    """(states, GPUs of the timed cells, processes their passes ran in, notes on records left out)."""
    folder = Folder(m, out)
    states, gpus, processes = [], set(), set()
    for cell in matrix_cells(m):
        if cell.method is None:
            states.append((_name(cell), folder.gate_state(cell)))
            continue
        state, passes = folder.cell_state(cell)
        states.append((_name(cell), state))
        row, differ = folder.row(cell)
        if state.startswith(("done", "parity FAIL")) or (row is None and passes):
            gpus |= folder.cell_gpus(row if not differ else None, passes)
            processes |= {json.dumps(p["process"], sort_keys=True) for p in passes if p.get("process")}
    return states, gpus, processes, list(dict.fromkeys(folder.notes))


def timed_gpus(m: Matrix, out: Path) -> list[str]:
    """Every GPU the timed cells of `m` ran their passes on, by UUID: as the pass records name them (a row's,
    where its pass records name none)."""
    return sorted(_read(m, out)[1])


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
    states, gpus, processes, notes = _read(m, out)
    timed = [s for n, s in states if not n.endswith(" gate")]
    done = sum(s.startswith("done") for s in timed)
    cannot = sum(s.startswith("cannot run") for s in timed)
    lines = [f"{done} of {len(timed)} timed cells done ({counted(m.steps, 'step')} x {counted(m.passes, 'pass')} each)"
             + (f"; {cannot} cannot run on {matrix_device(m)}." if cannot else "."), "",
             "| cell | state |", "|---|---|"]
    lines += [f"| {n} | {s} |" for n, s in states]
    if len(gpus) > 1:
        lines += ["", f"The timed cells ran on {len(gpus)} GPUs ({', '.join(_short(g) for g in sorted(gpus))}): a ratio "
                      "between cells of different GPUs compares machines as well as methods: a page prints one only "
                      "where both cells timed passes on every GPU either ran on (`--passes-per-part`), GPU by GPU, "
                      "and says 'other GPU' elsewhere."]
    if len(processes) > 1:
        lines += ["", f"Their passes ran in {len(processes)} processes."]
    if notes:
        lines += ["", "Left out:"] + [f"- {n}" for n in notes]
    recorded = parts(out)
    if recorded:
        lines += ["", "| part | started (UTC) | wall | timed passes | outside timed passes | exit | GPU |",
                  "|---|---|---|---|---|---|---|"]
        for i, p in enumerate(recorded, 1):
            phases = p.get("phases") or {}
            rest = ", ".join(f"{k} {v:.0f} s" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]) if k != TIMED)
            gpu = ", ".join(_short(g) for g in p.get("gpu") or [] if g) or "—"
            lines.append(f"| {i} | {_when(p.get('started'))} | {p.get('wall_s') or 0:.0f} s | {phases.get(TIMED, 0):.0f} s "
                         f"| {rest or '—'} | {_exit(p)} | {gpu} |")
        total = sum(p.get("wall_s") or 0 for p in recorded)
        timed_s = sum((p.get("phases") or {}).get(TIMED, 0) for p in recorded)
        lines += ["", f"{len(recorded)} parts, {total:.0f} s in all, {timed_s:.0f} s of it in timed passes "
                      f"({timed_s / total:.0%})." if total else ""]
    return "\n".join(lines).rstrip() + "\n"
