"""The matrix suites' pytest plugin: their options, and the hooks that parametrize them from `--matrix`; cells
run model by model, parity first.

`poros bench matrix` loads it (`-p poros.suites.plugin`) over the suites shipped in the package; a source
checkout's `suites/` folder runs the same suites under plain `pytest suites/ --matrix=NAME`.

Before any cell runs, the session start refuses bad settings, a missing device and models the
matrix cannot run, in one line each, and takes the results folder's lock; the folder then belongs to
this run as `poros bench`'s output folder does: an earlier run's files are moved into `earlier/N/`
(with `--resume`, kept and continued when they are this matrix's rows). Each cell then shows one
compact line (its outcome), the per-step detail only with -v (or in `poros bench`'s log).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pytest_benchmark.session import PerformanceRegression

from poros.common.atomic import write_atomic
from poros.common.folders import OutputLock, ensure_folder
from poros.config import Method
from poros.errors import PorosError, WriteError
from poros.harness import console, preflight
from poros.harness.cells import Cell, matrix_cells, matrix_device
from poros.harness.console import set_progress_writer
from poros.harness.compare import load_compare_source
from poros.harness.results import RUN_FILES, PassLog, ResultsWriter, keep_earlier, passes_path, row_key
from poros.harness import pytest_benchmark_adapter as adapter
from poros.suites.benchmarks import (check_compare, check_compared_cells, checkpoint, earlier_benchmarks, json_path,
                                     update_commit_info, update_json, update_machine_info)
from poros.suites import OUT_OF_TIME, WRITE_FAILED
from poros.suites.session import matrix_of, session_of

def pytest_addoption(parser):
    group = parser.getgroup("poros", "Poros matrix suites")
    group.addoption("--matrix", default="cpu", help="matrix name (matrices/NAME.yaml) or file; default: cpu")
    group.addoption("--steps", type=int, default=None, help="override the matrix's steps per pass (reduced run)")
    group.addoption("--passes", type=int, default=None, help="override the matrix's timed passes (reduced run)")
    group.addoption("--parity-steps", type=int, default=None, help="steps of the parity gate (default: the matrix's parity_steps)")
    group.addoption("--results", default="out/results.jsonl", help="results JSON Lines file cells are appended to")
    group.addoption("--resume", action="store_true",
                    help="skip cells already recorded in --results and continue unfinished ones after their last pass")
    group.addoption("--max-minutes", type=float, default=None,
                    help="stop between passes before this many minutes have passed (exit 75; --resume continues)")
    group.addoption("--passes-per-part", type=int, default=None,
                    help="time at most this many passes of each cell, then go on to the next cell (exit 75 where "
                         "one has passes left; --resume continues, on any GPU: a page pairs passes of one GPU)")


def _register_markers(config) -> None:
    config.addinivalue_line("markers", "bench: matrix benchmark cells (the matrix suites)")


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark reads its options
def pytest_configure(config):
    _register_markers(config)
    import importlib.metadata as md

    try:
        preflight.check_benchmark_json_resumable(md.version("pytest-benchmark"), config.getoption("--resume"))
    except PorosError as e:
        raise pytest.UsageError(str(e)) from None
    target = getattr(config.option, "benchmark_json", "absent")
    if target is None:  # keep its JSON beside the results
        results = Path(config.getoption("--results"))
        try:
            ensure_folder(results.parent, "results folder")
        except PorosError as e:
            raise pytest.UsageError(str(e)) from None
        target = results.with_name("benchmark.json")
    if target != "absent":
        # the suites write the JSON themselves, whole under a temporary name and renamed (`checkpoint`): after each
        # timed cell and at the session's end, a Ctrl-C or SIGTERM included; pytest-benchmark writes none of its own
        config._poros_json = Path(target.name if hasattr(target, "write") else target)  # (a file: pytest-benchmark<5.3)
        config.option.benchmark_json = None
    compare = getattr(config.option, "benchmark_compare", None)
    if isinstance(compare, str) and (compare.endswith(".json") or "/" in compare):
        try:  # a file: pytest-benchmark would stop on a missing one with an internal error
            load_compare_source(compare)
        except PorosError as e:
            raise pytest.UsageError(str(e)) from None
    config._poros_benchmarks = earlier_benchmarks(config)
    if console.status_writer() is None:  # plain pytest: SIGTERM ends the session as Ctrl-C does (`poros bench` sets it)
        import contextlib

        config._poros_signals = contextlib.ExitStack()
        config._poros_signals.enter_context(console.interrupt_on_sigint())


def pytest_sessionstart(session):
    config = session.config
    config._poros_pytest_session = session  # its exit status is set when a benchmark comparison fails
    try:
        deterministic = matrix_of(config)[1].deterministic
    except PorosError:  # the checks below refuse the matrix in one line
        deterministic = False
    if deterministic:
        # first, before any CUDA work: cuBLAS reads its workspace configuration once per process
        from poros.engine.methods.trainer import enable_determinism

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

    set_progress_writer(line if config.option.verbose > 0 or console.status_writer() is not None else None)
    config._poros_say = line
    config._poros_standalone = console.status_writer() is None  # not under `poros bench`, which owns its folder
    if console.status_writer() is None:  # `poros bench` routes it to the terminal, its log gets `line`
        console.set_status_writer(lambda msg, final: final and line(msg))
        config._poros_status = True
    try:
        _preflight(config)
        check_compare(config)
    except PorosError as e:
        raise pytest.UsageError(str(e)) from None


def _preflight(config) -> None:
    """Everything knowable before the first cell: counts, device, models, the results file."""
    preflight.check_counts("pytest suites/", steps=config.getoption("--steps"), passes=config.getoption("--passes"),
                           parity_steps=config.getoption("--parity-steps"))
    m = matrix_of(config)[1]
    if m.device is not None:
        preflight.check_device(m.device.value, f"{m.source}: device")
    preflight.check_matrix(m)
    preflight.check_matrix_ranks(m, matrix_device(m))
    preflight.check_matrix_attention(m, matrix_device(m))
    results = Path(config.getoption("--results"))
    unselected = preflight.no_cell_selected(m, config.getoption("keyword") or None)
    if unselected:  # before the folder is touched: nothing there moves
        raise PorosError(f"{m.source}: {unselected}; {results.parent}/ is left as it was")
    lock = OutputLock(results.parent).acquire()
    config.add_cleanup(lock.release)
    warning = lock.stale_warning()
    if warning:
        console.progress(warning)
    if config.option.collectonly:  # listing cells runs none: nothing to keep aside or to probe
        return
    if not config.getoption("--resume"):
        _keep_earlier(config, results)
    writer = ResultsWriter(results)
    warning = writer.repair()  # appending after a torn line would glue two rows together
    if warning:
        console.progress(warning)
    if config.getoption("--resume"):
        preflight.check_resume(writer.rows(), m, results, PassLog(passes_path(results)).records())
    kept = results.parent / "matrix.yaml"  # the matrix the run's rows measure, as it read when the run began
    if Path(m.source).is_file() and not (config.getoption("--resume") and kept.is_file()):
        write_atomic(kept, Path(m.source).read_bytes(), "the run's matrix", "the run has not started")
    warning = PassLog(passes_path(results)).writer.repair()
    if warning:
        console.progress(warning)
    minutes = config.getoption("--max-minutes")
    if minutes is not None and not minutes > 0:
        raise PorosError(f"--max-minutes: expected a number of minutes > 0, got {minutes!r}")
    per_part = config.getoption("--passes-per-part")
    if per_part is not None and per_part < 1:
        raise PorosError(f"--passes-per-part: expected a number of passes >= 1, got {per_part}")
    console.reset_phases()
    if matrix_device(m) == "cuda":  # before any cell takes memory: the link as this process finds it
        from poros.harness.link import h2d_gbps

        gbps = h2d_gbps("cuda")
        console.progress(f"host->device link: {gbps:.1f} GB/s (best of pinned copy probes; rows' copy_floor_s)")
        _say_other_hardware(m)


def _say_other_hardware(m) -> None:
    """A matrix that declares one GPU run on another: said at the start; its rows name the GPU they ran on."""
    from poros.provenance import is_hardware

    gpu = preflight.this_gpu(m)
    if m.hardware and gpu and not is_hardware(m.hardware, gpu):
        console.progress(f"{m.source}: hardware is {m.hardware}, this GPU is {gpu}: rows and pages name {gpu}, "
                         f"and its timings compare only with rows of the same GPU")


def _keep_earlier(config, results: Path) -> None:
    """A new run owns its results folder: an earlier run's files there (this matrix's or another's) are
    moved into `earlier/N/`, as `poros bench` moves them, so no row of it is mixed into this run's. Under
    `poros bench` they are gone already, and its log of this run stays."""
    names = {*RUN_FILES, results.name, f"{results.name}.torn", passes_path(results).name}
    record = json_path(config)
    if record is not None and record.parent.resolve() == results.parent.resolve():
        names.add(record.name)
    if not getattr(config, "_poros_standalone", True):
        names.discard("bench.log")
    kept, moved = keep_earlier(results.parent, sorted(names))
    if kept is not None:
        getattr(config, "_poros_say", console.progress)(f"kept the earlier run's {', '.join(moved)} in {kept}/")


def pytest_generate_tests(metafunc):
    if "cell" not in metafunc.fixturenames:
        return
    _, m = matrix_of(metafunc.config)
    gate = metafunc.function.__name__ == "test_parity"
    cells = [c for c in matrix_cells(m) if (c.method is None) == gate]
    # a matrix without a gate (one method) leaves test_parity no cell: pytest's empty-parameter item
    # is deselected below
    metafunc.parametrize("cell", cells, ids=[c.id for c in cells])


def _cell(item):
    spec = getattr(item, "callspec", None)
    cell = spec.params.get("cell") if spec is not None else None
    return cell if isinstance(cell, Cell) else None


def pytest_collection_modifyitems(config, items):
    cells = [c.key for c in matrix_cells(matrix_of(config)[1])]
    order = {k: i for i, k in enumerate(cells)}
    empty = [item for item in items if "cell" in getattr(item, "fixturenames", ()) and _cell(item) is None]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [item for item in items if item not in empty]

    def key(item):
        cell = _cell(item)
        return order.get(cell.key, len(order)) if cell else -1

    items.sort(key=key)


def pytest_collection_finish(session):
    config = session.config
    items = [item for item in session.items if _cell(item) is not None]
    cells = [_cell(item) for item in items]
    config._poros_cells, config._poros_index = len(cells), 0
    m = matrix_of(config)[1]
    device = matrix_device(m)
    state = session_of(config)
    why = [state.unrunnable(c) for c in cells]
    if cells and all(why):  # nothing would run: one line, not a run of skips that exits 0
        raise pytest.UsageError(f"{m.source}: no selected cell can run here: {why[0]}")
    check_compared_cells(config, [item for item, w in zip(items, why) if not w])
    # the gate holds the plans of the poros cells -k selected (every plan when it selected none)
    selected = {c.plan for c, w in zip(cells, why) if c.method is Method.POROS and not w}
    state.gate_plans = [p for p in m.plan_names() if p in selected] or None
    runnable = {c.model for c, w in zip(cells, why) if not w}
    try:  # only the models this session will build (-k may select a few)
        preflight.check_host_memory(sorted(runnable), device)
    except PorosError as e:
        raise pytest.UsageError(str(e)) from None
    _say_settings(m, [c for c, w in zip(cells, why) if not w])


def _say_settings(m, cells) -> None:
    """The settings each method (poros per plan) runs, once per method and plan, as the first model's cells
    resolve them on this device."""
    from poros.harness.cells import settings_line

    seen, lines = set(), []
    for c in cells:
        if c.method is None or (c.method, c.plan) in seen or c.model != cells[0].model:
            continue
        seen.add((c.method, c.plan))
        lines.append(settings_line(m, c))
    if lines:
        console.announce("settings (beside the table's defaults; poros/resolve.py for the device's):\n" +
                         "\n".join(lines))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    cell = _cell(item)
    if cell is None:
        return
    config = item.config
    config._poros_index = getattr(config, "_poros_index", 0) + 1
    item._poros_t0 = time.perf_counter()
    console.begin_cell(f"[cell {config._poros_index}/{getattr(config, '_poros_cells', '?')}] {cell.label}")


def _outcome(item, report) -> str:
    """The compact line's ending: the cell's result, why it was skipped, or why it failed."""
    cell = _cell(item)
    took = f" ({time.perf_counter() - getattr(item, '_poros_t0', time.perf_counter()):.1f} s)"
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return f"skipped: {reason.removeprefix('Skipped: ')}"
    session = item.funcargs.get("session") if hasattr(item, "funcargs") else None
    if cell.method is None:
        gates = session.gates.get(cell.gate_key) if session is not None else None
        outcomes = [(p, g) for p, g in (gates or {}).items() if not isinstance(g, Exception)]
        if outcomes:
            parts = []
            for plan, gate in outcomes:
                detail = (f"{gate.method} vs {gate.gate}: {gate.tensors_compared} tensors, "
                          f"{gate.steps} step{'s' if gate.steps != 1 else ''}")
                if not gate.ok:
                    detail += f", first mismatch {gate.first_mismatch}, max |diff| {gate.max_abs_diff:.3e}"
                parts.append(("" if plan is None else f"{plan}: ") + f"parity {gate.parity} ({detail})")
            return "; ".join(parts) + took
    row = session.writer.last if session is not None else None
    if row is not None and row_key(row) != cell.key:
        row = None  # the row of an earlier cell: this one wrote none
    if report.passed and row is not None and row.get("s_per_step_median") is not None:
        vram = f", peak {row['peak_vram_gb']:.2f} GB" if row.get("peak_vram_gb") is not None else ""
        return f"{row['s_per_step_median']:.4f} s/step{vram}{took}"
    if report.passed and row is not None and not row.get("timed", True):
        return f"gate {row.get('parity') or 'not gated'}, not timed{took}"
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message.splitlines()[0] if crash is not None and crash.message else "see the log"
        message = message.removeprefix("Failed: ")  # pytest.fail's own word, beside ours
        return f"FAILED: {message[:200]}{took}"
    return f"done{took}"


def _stop_at_write_failure(item, error: WriteError) -> None:
    """A record that could not be written (a full disk, a file-size limit) ends the run after this cell: what is
    recorded stays whole, and --resume continues from it once there is room (exit WRITE_FAILED)."""
    state = session_of(item.config)
    state.write_failed = state.write_failed or str(error)
    item.session.shouldstop = f"stopped: {state.write_failed}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _cell(item) is None:
        return
    if call.excinfo is not None and call.excinfo.errisinstance(WriteError):
        _stop_at_write_failure(item, call.excinfo.value)
    if (report.when == "call" or (report.when == "setup" and not report.passed)) and not getattr(
            item, "_poros_reported", False):
        item._poros_reported = True
        item._poros_ran = not report.skipped
        console.end_cell(_outcome(item, report))
    state = getattr(item.config, "_poros_session", None)
    if report.when != "teardown":
        return
    try:
        if getattr(item, "_poros_ran", False) and state is not None and state.ran:
            # the cell's benchmark is taken at its teardown: a lost machine keeps it, and the part's record so far
            checkpoint(item.config)
            state.record_part()
        else:  # a skipped cell whose benchmark holds rounds: a finished cell's entry written from its row
            bench = getattr(item, "funcargs", {}).get("benchmark")
            if bench is not None and bench.stats is not None and not bench.has_error:
                checkpoint(item.config)
    except WriteError as e:
        _stop_at_write_failure(item, e)


def pytest_keyboard_interrupt(excinfo):
    console.end_cell("interrupted")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    state = getattr(session.config, "_poros_session", None)
    if state is not None and state.unfinished and not state.stopped and exitstatus == 0:
        session.exitstatus = OUT_OF_TIME  # cells with passes left for the next part (--passes-per-part)
    if state is not None and state.stopped and exitstatus == 0:
        session.exitstatus = OUT_OF_TIME
        if state.records_made() == state.records_at_start:  # the same part again would get no further: not 75
            state.no_progress = (f"stopped at the time budget (--max-minutes {state.max_minutes:g}) before a pass, "
                                 f"gate or row was recorded: a part this short makes no progress; raise --max-minutes")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            getattr(session.config, "_poros_say", console.progress)(state.no_progress)
    try:
        checkpoint(session.config)  # every timed cell's benchmark, the earlier parts' kept (the JSON's last write)
    except WriteError as e:
        if state is not None:
            state.write_failed = state.write_failed or str(e)
    if state is not None and (state.ran or state.stopped) and state.write_failed is None:
        try:
            state.record_part(int(session.exitstatus))
        except WriteError as e:
            state.write_failed = str(e)
    if state is not None and state.write_failed is not None:
        session.exitstatus = WRITE_FAILED
        getattr(session.config, "_poros_say", console.progress)(f"{state.write_failed}; the run stopped there")
    elif state is not None and state.ran:
        if state.keep_exports and not state.stopped:  # the run is complete: no later part needs them
            from poros.harness.unsloth import remove_kept_exports

            remove_kept_exports()


@pytest.hookimpl(wrapper=True)
def pytest_terminal_summary(terminalreporter, config):
    """pytest-benchmark raises its regression out of pytest's session end, which skips every plugin's
    unconfigure and ends in a traceback: here it fails the run (exit 1) after its table and lines naming each
    regression."""
    compared = adapter.compare_source(config)[1]
    if compared:
        config._poros_compared = sum(1 for b in adapter.timed_benchmarks(config) if any(
            b.fullname in names for names in compared.values()))
    try:
        return (yield)
    except PerformanceRegression:
        found = adapter.regressions(config)
        config._poros_regressions = [f"{name} - {why}" for name, why in found]
        session = getattr(config, "_poros_pytest_session", None)
        if session is not None and session.exitstatus in (pytest.ExitCode.OK, OUT_OF_TIME):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        sources = ", ".join(map(str, compared))
        terminalreporter.write_line(f"benchmark comparison with {sources}: {len(found)} "
                                    f"regression(s) past --benchmark-compare-fail; exit status 1", red=True)
        return None


def pytest_benchmark_update_machine_info(config, machine_info):
    update_machine_info(machine_info)


def pytest_benchmark_update_commit_info(config, commit_info):
    update_commit_info(commit_info)


def pytest_benchmark_update_json(config, benchmarks, output_json):
    update_json(config, output_json)


def pytest_unconfigure(config):
    stack = getattr(config, "_poros_signals", None)
    if stack is not None:
        stack.close()
    set_progress_writer(None)
    if getattr(config, "_poros_status", False):  # this session installed it: the next starts afresh
        console.set_status_writer(None)


@pytest.fixture(scope="session")
def session(request):
    return session_of(request.config)


# A source checkout's suites/conftest.py takes the hooks and the fixture (`from poros.suites.plugin import *`), its
# root conftest.py the options: pytest reads options from the conftest files at its root alone.
__all__ = sorted(name for name, value in globals().items()
                 if name.startswith("pytest_") and name != "pytest_addoption" and callable(value)) + ["session"]
