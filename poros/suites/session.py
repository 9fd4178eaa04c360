"""One run of the matrix suites (`Session`): its matrix as the options reduce it, results file, pass log, store
cache, gate outcomes and time budget, shared by its cells (poros/suites/plugin.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from poros.engine.methods.registry import METHODS, method_unavailable
from poros.harness import console, preflight
from poros.harness.budget import TimeBudget
from poros.harness.cell_memory import StoreCache
from poros.harness.cells import cell_fingerprint, matrix_cells, matrix_device, model_unavailable
from poros.harness.results import PassLog, ResultsWriter, passes_path

def this_process(started: float) -> dict:
    """What names the process a pass log's records come from: its host, pid and start time (seconds since the
    epoch), together unique to one run."""
    import socket

    return {"host": socket.gethostname(), "pid": os.getpid(), "started": round(started, 6)}


def matrix_of(config):
    """(the matrix `--matrix` names, the same with `--steps` and `--passes` applied)."""
    m = preflight.load_matrix(config.getoption("--matrix"))
    reduced = m.with_overrides(config.getoption("--steps"), config.getoption("--passes"))
    return m, reduced


class Session:
    """State shared by the cells of one run: matrix, results file, pass log, store cache, gate outcomes,
    the time budget."""

    def __init__(self, config):
        self.config = config
        self.full, self.matrix = matrix_of(config)
        self.reduced = (self.matrix.steps, self.matrix.passes) != (self.full.steps, self.full.passes)
        given = config.getoption("--parity-steps")  # 0 is refused at session start, never replaced
        self.parity_steps = self.matrix.parity_steps if given is None else given
        results = Path(config.getoption("--results"))
        self.writer = ResultsWriter(results)
        self.started = time.time()
        self.process = this_process(self.started)
        self.passlog = PassLog(passes_path(results), process=self.process)
        self.ignored: set[str] = set()  # pass records left out, said once each
        self.references = results.with_name("gate-references")  # gate references kept as digests, by fingerprint
        self.resume = config.getoption("--resume")
        self.timed = not getattr(config.option, "benchmark_disable", False)
        self.device = matrix_device(self.matrix)
        self.stores = StoreCache(self.device)
        self.gates: dict[tuple, dict] = {}
        self.cells = matrix_cells(self.matrix)
        self.index = 0
        self.gate_plans: list | None = None  # the plans the gate holds (None: every plan of the matrix)
        self.max_minutes = config.getoption("--max-minutes")
        self.budget = None if self.max_minutes is None else TimeBudget(self.max_minutes)
        self.stopped = False  # a cell stopped at the time budget
        self.passes_per_part = config.getoption("--passes-per-part")
        self.unfinished = False  # a cell timed the passes this part runs of it (--passes-per-part) and has more
        # a run in parts keeps Unsloth's export of the weights on disk for the next part (removed when complete)
        self.keep_exports = self.max_minutes is not None or self.passes_per_part is not None
        self.ran = False  # a cell got past its checks: the part is recorded from then on
        self.part_id = f"{self.started:.6f}-{os.getpid()}"  # the records of this part (one run) in the pass log
        self.write_failed: str | None = None  # the first record this run could not write: it stops there
        self.records_at_start = self.records_made()
        self.no_progress: str | None = None  # why this part, stopped at the time budget, recorded nothing

    def record_part(self, exit_status: int | None = None) -> None:
        """What this run (a part, under --resume) spent where: wall time and seconds per phase (store
        builds, gates, trainer set-ups, warm-ups, timed passes, Unsloth's children), in the pass log.

        Recorded when the first cell runs, again after each cell and at the run's end (`exit_status`; None
        before it), each record under the part's id: where the machine is lost mid-run, the pass log still
        says what the part ran, on which GPU, up to its last finished cell."""
        from poros.provenance import provenance

        p = provenance()
        now = time.time()
        phases = {k: round(v, 1) for k, v in console.phase_times().items()}
        self.passlog.add("part", "", "", part_id=self.part_id, started=self.started, ended=now,
                         wall_s=round(now - self.started, 1), phases=phases, exit_status=exit_status,
                         stopped=self.stopped, gpu=[g.get("uuid") for g in p.get("gpus") or []],
                         max_minutes=self.max_minutes, passes_per_part=self.passes_per_part,
                         steps=self.matrix.steps, passes=self.matrix.passes)
        if exit_status is not None:
            console.progress(f"this run: {now - self.started:.0f} s; " +
                             ", ".join(f"{k} {v:.0f} s" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])))

    def passes(self, cell) -> list[dict]:
        """The passes the pass log keeps for `cell`: passes 0 to passes-1, each once; a record past them (added by
        hand, or a second record of a pass) is left out, and said so once."""
        fp, count = self.cell_fingerprint(cell), self.matrix.passes
        for why in self.passlog.ignored_passes(cell.id, fp, count):
            if why not in self.ignored:
                self.ignored.add(why)
                console.progress(f"  ignored: {why}")
        return self.passlog.passes(cell.id, fp, count)

    @property
    def total(self) -> int:
        return getattr(self.config, "_poros_cells", None) or len(self.cells)

    def out_of_time(self) -> bool:
        return self.stopped or (self.budget is not None and self.budget.expired())

    def records_made(self) -> int:
        """Rows and pass, gate and reference records in the run's files (a part that adds none made no progress)."""
        return len(self.writer.rows()) + sum(r.get("kind") != "part" for r in self.passlog.records())

    def unrunnable(self, cell) -> str | None:
        """Why `cell` cannot run on this machine (None when it can)."""
        why = cell.stack.mismatch() or model_unavailable(cell.model, self.device)
        if why or cell.method is None:
            return why
        why = method_unavailable(cell.method, self.device)
        if why:
            return why
        gpus = self.matrix.settings_for(cell.model, dict(cell.point), cell.method).get("gpus", 1)
        if gpus > 1 and not METHODS[cell.method].in_process:
            return f"{cell.method.value} runs as one process: gpus: {gpus} is for the in-process methods"
        return None

    def cell_fingerprint(self, cell) -> str:
        """The fingerprint of `cell`'s passes in the pass log (`poros.harness.cells.cell_fingerprint`)."""
        return cell_fingerprint(self.matrix, cell)


def session_of(config) -> Session:
    if getattr(config, "_poros_session", None) is None:
        config._poros_session = Session(config)
    return config._poros_session
