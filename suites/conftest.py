"""Parametrize the matrix suites from `--matrix`; cells run model by model, parity first.

Before any cell runs, the session start refuses bad settings, a missing device and models the
matrix cannot run, in one line each, and takes the results folder's lock; each cell then shows
one compact line (its outcome), the per-step detail only with -v (or in `poros bench`'s log).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from poros.harness import bench, preflight
from poros.harness.bench import ResultsWriter, StoreCache, matrix_cells, matrix_device, set_progress_writer
from poros.errors import PorosError
from poros.harness.results import OutputLock, ensure_folder


def _matrix(config):
    m = preflight.load_matrix(config.getoption("--matrix"))
    reduced = m.with_overrides(config.getoption("--steps"), config.getoption("--passes"))
    return m, reduced


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark reads its options
def pytest_configure(config):
    if getattr(config.option, "benchmark_json", "absent") is None:  # keep its JSON beside the results
        results = Path(config.getoption("--results"))
        try:
            ensure_folder(results.parent, "results folder")
        except PorosError as e:
            raise pytest.UsageError(str(e)) from None
        config.option.benchmark_json = results.with_name("benchmark.json")


def pytest_sessionstart(session):
    config = session.config
    try:
        deterministic = _matrix(config)[1].deterministic
    except PorosError:  # the checks below refuse the matrix in one line
        deterministic = False
    if deterministic:
        # first, before any CUDA work: cuBLAS reads its workspace configuration once per process
        from poros.engine.trainer import enable_determinism

        enable_determinism()
    tw = config.get_terminal_writer()
    capman = config.pluginmanager.getplugin("capturemanager")

    def line(msg: str) -> None:
        if capman is None:
            tw.line(msg)
        else:
            with capman.global_and_fixture_disabled():  # fd-level capture would swallow it
                tw.line(msg)
        tw.flush()

    set_progress_writer(line if config.option.verbose > 0 or bench.status_writer() is not None else None)
    if bench.status_writer() is None:  # `poros bench` routes it to the terminal, its log gets `line`
        bench.set_status_writer(lambda msg, final: final and line(msg))
        config._poros_status = True
    try:
        _preflight(config)
    except PorosError as e:
        raise pytest.UsageError(str(e)) from None


def _preflight(config) -> None:
    """Everything knowable before the first cell: counts, device, models, the results file."""
    preflight.check_counts("pytest suites/", steps=config.getoption("--steps"), passes=config.getoption("--passes"),
                           parity_steps=config.getoption("--parity-steps"))
    m = _matrix(config)[1]
    if m.device is not None:
        preflight.check_device(m.device.value, f"{m.source}: device")
    preflight.check_matrix(m)
    preflight.check_ranks(m.settings.get("gpus", 1), bench.matrix_device(m), f"{m.source}: gpus")
    results = Path(config.getoption("--results"))
    lock = OutputLock(results.parent).acquire()
    config.add_cleanup(lock.release)
    warning = lock.stale_warning()
    if warning:
        bench.progress(warning)
    warning = ResultsWriter(results).repair()  # appending after a torn line would glue two rows together
    if warning:
        bench.progress(warning)


def pytest_generate_tests(metafunc):
    if "cell" not in metafunc.fixturenames:
        return
    _, m = _matrix(metafunc.config)
    gate = metafunc.function.__name__ == "test_parity"
    cells = [c for c in matrix_cells(m) if (c.method is None) == gate]
    metafunc.parametrize("cell", cells, ids=[c.id for c in cells])


def pytest_collection_modifyitems(config, items):
    cells = [c.key for c in matrix_cells(_matrix(config)[1])]
    order = {k: i for i, k in enumerate(cells)}

    def key(item):
        cell = getattr(item, "callspec", None) and item.callspec.params.get("cell")
        return order.get(cell.key, len(order)) if cell else -1

    items.sort(key=key)


def pytest_collection_finish(session):
    config = session.config
    cells = [item.callspec.params["cell"] for item in session.items if "cell" in getattr(item, "fixturenames", ())]
    config._poros_cells, config._poros_index = len(cells), 0
    m = _matrix(config)[1]
    device = matrix_device(m)
    runnable = {c.model for c in cells if not c.stack.mismatch() and not bench.model_unavailable(c.model, device)}
    try:  # only the models this session will build (-k may select a few)
        preflight.check_host_memory(sorted(runnable), device)
    except PorosError as e:
        raise pytest.UsageError(str(e)) from None


def _cell(item):
    spec = getattr(item, "callspec", None)
    return spec.params.get("cell") if spec is not None else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    cell = _cell(item)
    if cell is None:
        return
    config = item.config
    config._poros_index = getattr(config, "_poros_index", 0) + 1
    what = cell.method.value if cell.method else "parity gate"
    stack = "" if cell.stack.name == "current" else f" [{cell.stack.name}]"
    item._poros_t0 = time.perf_counter()
    bench.begin_cell(f"[cell {config._poros_index}/{getattr(config, '_poros_cells', '?')}] {cell.model}{stack} {what}")


def _outcome(item, report) -> str:
    """The compact line's ending: the cell's result, why it was skipped, or why it failed."""
    cell = _cell(item)
    took = f" ({time.perf_counter() - getattr(item, '_poros_t0', time.perf_counter()):.1f} s)"
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return f"skipped: {reason.removeprefix('Skipped: ')}"
    session = item.funcargs.get("session") if hasattr(item, "funcargs") else None
    if cell.method is None:
        gate = session.gates.get((cell.model, cell.stack.name)) if session is not None else None
        if gate is not None and not isinstance(gate, Exception):
            detail = (f"{gate.method} vs {gate.gate}: {gate.tensors_compared} tensors, "
                      f"{gate.steps} step{'s' if gate.steps != 1 else ''}")
            if not gate.ok:
                detail += f", first mismatch {gate.first_mismatch}, max |diff| {gate.max_abs_diff:.3e}"
            return f"parity {gate.parity} ({detail}){took}"
    row = session.writer.last if session is not None else None
    if row is not None and (row.get("model"), row.get("stack_name"), row.get("method")) != cell.key:
        row = None  # the row of an earlier cell: this one wrote none
    if report.passed and row is not None and row.get("s_per_step_median") is not None:
        vram = f", peak {row['peak_vram_gb']:.2f} GB" if row.get("peak_vram_gb") is not None else ""
        return f"{row['s_per_step_median']:.4f} s/step{vram}{took}"
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message.splitlines()[0] if crash is not None and crash.message else "see the log"
        return f"FAILED: {message[:200]}{took}"
    return f"done{took}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _cell(item) is None:
        return
    if (report.when == "call" or (report.when == "setup" and not report.passed)) and not getattr(
            item, "_poros_reported", False):
        item._poros_reported = True
        bench.end_cell(_outcome(item, report))


def pytest_keyboard_interrupt(excinfo):
    bench.end_cell("interrupted")


def pytest_unconfigure(config):
    set_progress_writer(None)
    if getattr(config, "_poros_status", False):  # this session installed it: the next starts afresh
        bench.set_status_writer(None)


class Session:
    """State shared by the cells of one run: matrix, results file, store cache, gate outcomes."""

    def __init__(self, config):
        self.full, self.matrix = _matrix(config)
        self.reduced = (self.matrix.steps, self.matrix.passes) != (self.full.steps, self.full.passes)
        given = config.getoption("--parity-steps")  # 0 is refused at session start, never replaced
        self.parity_steps = self.matrix.parity_steps if given is None else given
        self.writer = ResultsWriter(config.getoption("--results"))
        self.resume = config.getoption("--resume")
        self.device = matrix_device(self.matrix)
        self.stores = StoreCache(self.device)
        self.gates: dict[tuple, object] = {}
        self.total = getattr(config, "_poros_cells", None) or len(matrix_cells(self.matrix))
        self.index = 0


@pytest.fixture(scope="session")
def session(request):
    return Session(request.config)
