"""`poros bench matrix FILE -o OUT/`: run the matrix suites and render OUT/report.md."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from poros.cli.report import add_reference_argument, reference_path
from poros.cli.streams import ConsoleStream
from poros.common.folders import OutputLock, ensure_folder
from poros.errors import PorosError
from poros.paths import path_arg
from poros.harness import preflight
from poros.harness.compare import load_compare_source, parse_compare_fail, pass_length_problem
from poros.harness.matrix import resolve_matrix_path
from poros.harness.report import write_report
from poros.harness.results import PassLog, ResultsWriter, keep_earlier, passes_path
from poros.suites import OUT_OF_TIME, WRITE_FAILED  # stopped by --max-minutes with cells left; at a failed write

EPILOG = """examples:
  poros bench matrix matrices/cpu.yaml -o out/
  poros bench matrix matrices/h200.yaml -o out/h200 --steps 20 --passes 3 -k model:qwen2.5-32b
  poros bench matrix matrices/h200.yaml -o out/h200 -k "method:poros and plan:24GB"
  poros bench matrix matrices/h200.yaml -o out/h200 --resume      # continue a killed run
  poros bench matrix matrices/h200.yaml -o out/h200 --resume --max-minutes 8   # in parts: repeat until exit 0
  poros bench matrix matrices/h200.yaml -o out/h200 -k model:qwen2.5-72b --resume --passes-per-part 1
      # a model whose cells outlast one machine: one pass of each cell a part, each part on one GPU
  poros bench matrix matrices/cpu.yaml -o out/now --benchmark-compare results/cpu/benchmark.json \\
      --benchmark-compare-fail mean:25%          # exit 1 if a cell's mean pass is 25 % slower than then

Cell ids read model:M-stack:S[-SETTING:V...]-method:M[-plan:P] (or gate:parity) and -k selects by any
part of them. Writes OUT/results.jsonl (one line per finished cell), OUT/passes.jsonl (each timed pass
and gate outcome as it ends), OUT/bench.log (the full log), OUT/benchmark.json (pytest-benchmark, one
entry per timed cell, kept across --resume) and OUT/report.md (+ report.png); shows one line per cell.
An earlier run's files in OUT are moved to OUT/earlier/N/, never overwritten; one run at a time owns
OUT. --resume continues a cell after its last finished pass, and refuses rows measured with other
settings. Exits 1 if any cell failed (parity FAIL included) or regressed past --benchmark-compare-fail, or
-k selects no cell (said before OUT is touched),
75 when --max-minutes stopped it with cells left or --passes-per-part left passes (run the same command
again), 74 when a record could
not be written (a full disk, a file-size limit: make room, then --resume; nothing finished is lost).
"""

SUITES = Path(__file__).resolve().parent.parent / "suites"  # shipped in the package (poros/suites)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run benchmark matrices", epilog=EPILOG)
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    m = bsub.add_parser("matrix", help="run every cell of a matrix file", epilog=EPILOG)
    m.add_argument("file", type=path_arg, help="matrix file or name (cpu, h200, b300, a100)")
    m.add_argument("-o", "--out", default="out", type=path_arg, help="output folder (default: out/)")
    m.add_argument("--steps", type=int, help="steps per pass (default: the matrix's; fewer is a reduced run, flagged "
                                             "in the report)")
    m.add_argument("--passes", type=int, help="timed passes (default: the matrix's; fewer is a reduced run)")
    m.add_argument("--parity-steps", type=int, help="optimizer steps of the parity gate (default: the matrix's "
                                                    "parity_steps)")
    m.add_argument("-k", dest="keyword", help="pytest -k expression over cell ids, e.g. 'qwen2.5-32b and poros'")
    m.add_argument("--resume", action="store_true",
                   help="skip cells already in OUT/results.jsonl, continue unfinished ones after their last pass")
    m.add_argument("--max-minutes", type=float, metavar="MIN",
                   help="stop between passes before MIN minutes have passed (exit 75; --resume continues): a pass is "
                        "judged by the last one timed; a cell's first warm-up, with no pass to judge it by, "
                        "starts whatever time is left")
    m.add_argument("--passes-per-part", type=int, metavar="N",
                   help="time at most N passes of each single-GPU cell, then go on to the next (exit 75 where a cell "
                        "has passes left; --resume continues): each part then times every cell on one GPU, so a "
                        "page pairs two cells' passes GPU by GPU where a model's cells do not fit one machine's time")
    m.add_argument("--benchmark-compare", metavar="PATH", type=path_arg,
                   help="compare each timed cell with the same cell in PATH, an earlier run's benchmark.json "
                        "(the table is in OUT/bench.log)")
    m.add_argument("--benchmark-compare-fail", metavar="EXPR", nargs="+", action="extend",
                   help="with --benchmark-compare: fail (exit 1) when a cell regressed past EXPR, e.g. mean:10%% "
                        "(10 %% slower) or min:0.5 (0.5 s slower per pass)")
    add_reference_argument(m)
    m.set_defaults(run=run)
    st = bsub.add_parser("status", help="where a run in parts stands: cells done, passes kept, what each part took",
                         epilog="examples:\n  poros bench status matrices/h200.yaml -o results/h200\n",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("file", type=path_arg, help="the run's matrix file or name")
    st.add_argument("-o", "--out", required=True, type=path_arg, help="the run's output folder")
    st.add_argument("--steps", type=int, help="the run's steps per pass (default: as its parts recorded them, else "
                                             "the matrix's)")
    st.add_argument("--passes", type=int, help="the run's timed passes (default: as its parts recorded them, else "
                                              "the matrix's)")
    st.set_defaults(run=run_status)


def run_status(args) -> int:
    from poros.harness.progress import run_counts, status_markdown

    m = preflight.load_matrix(args.file)
    preflight.check_counts("poros bench status", steps=args.steps, passes=args.passes)
    out = Path(args.out)
    if not (out / "results.jsonl").exists() and not (out / "passes.jsonl").exists():
        raise PorosError(f"{out}: no results.jsonl or passes.jsonl there: pass the output folder of a "
                         f"`poros bench matrix` run (-o)")
    m = run_counts(m, out) if args.steps is None and args.passes is None else m.with_overrides(args.steps, args.passes)
    print(status_markdown(m, out), end="")
    return 0


def command_line(args, resume: bool) -> str:
    """The command that runs this benchmark again (`--resume`: continuing it)."""
    prog = "poros" if Path(sys.argv[0]).name == "poros" else f"{shlex.quote(sys.executable)} -m poros"
    words = ["bench", "matrix", args.file, "-o", args.out]
    for opt in ("steps", "passes", "parity_steps", "max_minutes", "passes_per_part"):
        if getattr(args, opt, None) is not None:
            words += [f"--{opt.replace('_', '-')}", f"{getattr(args, opt):g}"]
    if args.keyword:
        words += ["-k", args.keyword]
    if args.reference:
        words += ["--reference"] + ([] if args.reference is True else [args.reference])
    if getattr(args, "benchmark_compare", None):
        words += ["--benchmark-compare", args.benchmark_compare]
    if getattr(args, "benchmark_compare_fail", None):
        words += ["--benchmark-compare-fail", *args.benchmark_compare_fail]
    return " ".join([prog, shlex.join(words)] + (["--resume"] if resume else []))


class RunLog:
    """While the suites run, file descriptors 1 and 2 (pytest, warnings, child processes) go to
    OUT/bench.log; `terminal` is the real stderr, for the one line per cell."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> "RunLog":
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.start = os.fstat(fd).st_size
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # read back through a handle of its own: the lines stay readable should the file be removed during the run
        self._reader = self.path.open("rb")
        # the terminal as the command line's own standard error behaves: escapes, a reader gone is silence
        self.terminal = ConsoleStream(os.fdopen(os.dup(self._saved[1]), "w", buffering=1, errors="backslashreplace"),
                                      "to standard error")
        # Python's own streams too, wherever they pointed (pytest prints its usage errors there); a log that cannot
        # be written (a full disk, a file-size limit) is said once the run ends, and the run goes on
        self._streams = (sys.stdout, sys.stderr)
        self.logs = [ConsoleStream(open(fd, "w", buffering=1, closefd=False, errors="backslashreplace"),
                                   f"the log {self.path}", keep_going=True) for fd in (1, 2)]
        sys.stdout, sys.stderr = self.logs
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = self._streams
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self.terminal.close()
        self._reader.close()

    @property
    def failure(self) -> str | None:
        """Why the log stopped taking lines (None: it took them all)."""
        return next((s.failure for s in self.logs if s.failure), None)

    def since_start(self) -> list[str]:
        """The lines written since the run began (inside the `with`)."""
        self._reader.seek(self.start)
        return self._reader.read().decode("utf-8", "replace").splitlines()


class Tally:
    """pytest plugin: each cell's outcome (passed, failed or skipped), and the benchmark regressions the
    suites found against --benchmark-compare."""

    def __init__(self):
        self.outcomes: dict[str, str] = {}
        self.regressions: list[str] = []
        self.compared = 0  # timed cells that had a cell to compare with
        self.config = None

    def pytest_configure(self, config) -> None:
        self.config = config

    def pytest_unconfigure(self, config) -> None:
        self.regressions = list(getattr(config, "_poros_regressions", []))
        self.compared = getattr(config, "_poros_compared", 0)

    @property
    def no_progress(self) -> str | None:
        """Why the run stopped at its time budget having recorded nothing (a part as short makes no progress)."""
        return getattr(getattr(self.config, "_poros_session", None), "no_progress", None)

    @property
    def stopped(self) -> bool:
        """Whether the time budget stopped the run (else exit 75 came from cells with passes left to a later part)."""
        return bool(getattr(getattr(self.config, "_poros_session", None), "stopped", False))

    @property
    def write_failed(self) -> str | None:
        """The record the suites could not write, where they stopped at one (read once they have ended)."""
        return getattr(getattr(self.config, "_poros_session", None), "write_failed", None)

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed or report.when == "call" or (report.when == "setup" and report.skipped):
            if self.outcomes.get(report.nodeid) != "failed":
                self.outcomes[report.nodeid] = report.outcome

    def summary(self) -> str:
        counts = {k: sum(v == k for v in self.outcomes.values()) for k in ("passed", "failed", "skipped")}
        return ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no cell ran"


def _preflight(args):
    """Everything knowable before any work: the matrix, the counts, the device, the models, the
    selection and the reference file. Returns the matrix."""
    from poros.harness.cells import matrix_device, model_unavailable

    m = preflight.load_matrix(args.file)
    preflight.check_counts("poros bench", steps=args.steps, passes=args.passes, parity_steps=args.parity_steps)
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise PorosError(f"--max-minutes: expected a number of minutes > 0, got {args.max_minutes:g}")
    if args.passes_per_part is not None and args.passes_per_part < 1:
        raise PorosError(f"--passes-per-part: expected a number of passes >= 1, got {args.passes_per_part}")
    if m.device is not None:
        preflight.check_device(m.device.value, f"{m.source}: device")
    preflight.check_matrix(m)
    preflight.check_keyword(args.keyword)
    if args.reference:
        preflight.check_reference(reference_path(args.reference))
    if args.benchmark_compare_fail and not args.benchmark_compare:
        raise PorosError("--benchmark-compare-fail needs --benchmark-compare PATH: the benchmark.json of the run "
                         "to compare with, e.g. --benchmark-compare results/cpu/benchmark.json")
    parse_compare_fail(args.benchmark_compare_fail)
    if args.benchmark_compare:
        problem = pass_length_problem(load_compare_source(args.benchmark_compare), args.steps or m.steps)
        if problem:
            raise PorosError(f"--benchmark-compare {args.benchmark_compare}: {problem}")
    device = matrix_device(m)
    preflight.check_runnable(m, device)
    preflight.check_matrix_attention(m, device)
    if not args.keyword:  # with -k the suites check the models it selects, after collecting them
        preflight.check_host_memory([x for x in m.models if model_unavailable(x, device) is None], device)
    if not (SUITES / "test_matrix.py").is_file():
        raise PorosError(f"the matrix suites are missing from this installation ({SUITES}): reinstall poros")
    return m.with_overrides(args.steps, args.passes)


def run(args) -> int:
    from poros.harness.console import interrupt_on_sigint, interrupted_by

    m = _preflight(args)
    unselected = preflight.no_cell_selected(m, args.keyword)  # before OUT is touched: nothing there moves
    if unselected:
        print(f"poros bench: {unselected}", file=sys.stderr)
        return 1
    out = ensure_folder(args.out)
    with OutputLock(out, command=command_line(args, resume=False)) as lock, interrupt_on_sigint():
        try:
            return _run_locked(args, m, out, lock)
        except KeyboardInterrupt:
            import signal

            signum = interrupted_by() or signal.SIGINT
            print(f"\nporos bench: interrupted ({signal.Signals(signum).name}); finished cells are kept in "
                  f"{out / 'results.jsonl'}, their benchmarks in {out / 'benchmark.json'}. Continue with:\n  "
                  f"{command_line(args, resume=True)}", file=sys.stderr)
            return 128 + signum


def _run_locked(args, m, out: Path, lock) -> int:
    import pytest

    from poros.harness.console import StatusLine, set_status_writer

    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if lock.stale_warning():
        say(lock.stale_warning())
    results = out / "results.jsonl"
    if args.resume:
        writer = ResultsWriter(results)
        warning = writer.repair()
        if warning:
            say(warning)
        records = PassLog(passes_path(results)).records()
        preflight.check_resume(writer.rows(), m, results, records)
        if not writer.rows() and not records:  # the first part of a run in parts, or a mistyped -o
            say(f"--resume: nothing recorded in {out} yet; the run starts at its first cell")
        kept, names = None, []  # the suites append this run's benchmarks to benchmark.json
    else:
        kept, names = keep_earlier(out)
    if kept is not None:
        say(f"kept the earlier run's {', '.join(names)} in {kept}/")
    compare = args.benchmark_compare and Path(args.benchmark_compare).resolve()
    if compare and kept is not None and compare.parent == out.resolve() and compare.name in names:
        compare = kept / compare.name  # the earlier run compared with was just moved aside
    # the suites as the package ships them, under their own configuration; their ids read suites/test_matrix.py::...
    argv = [str(SUITES / "test_matrix.py"), "-p", "poros.suites.plugin", "-c", str(SUITES / "pytest.ini"),
            "--rootdir", str(SUITES.parent), f"--matrix={resolve_matrix_path(args.file)}", f"--results={results}",
            f"--benchmark-json={out / 'benchmark.json'}", "-p", "no:cacheprovider", "-q", "-rs"]
    for opt in ("steps", "passes", "parity_steps", "max_minutes", "passes_per_part"):
        if getattr(args, opt) is not None:
            argv.append(f"--{opt.replace('_', '-')}={getattr(args, opt)}")
    if args.keyword:
        argv += ["-k", args.keyword]
    if args.resume:
        argv.append("--resume")
    if compare:
        argv.append(f"--benchmark-compare={compare}")
    if args.benchmark_compare_fail:
        argv += ["--benchmark-compare-fail", *args.benchmark_compare_fail]
    tally = Tally()
    t0 = time.perf_counter()
    with RunLog(out / "bench.log") as log:
        print(f"=== {command_line(args, args.resume)}  ({time.strftime('%Y-%m-%d %H:%M:%S')})", flush=True)
        set_status_writer(StatusLine(log.terminal))
        try:
            code = pytest.main(argv, plugins=[tally])
        finally:
            set_status_writer(None)
        lines = log.since_start()
    if log.failure:
        say(f"poros bench: warning: {log.failure}; the log stops there")
    if code == WRITE_FAILED or tally.write_failed:
        say(f"poros bench: error: {tally.write_failed}. Every finished pass and row is kept in {out}; once there is "
            f"room, continue with:\n  {command_line(args, resume=True)}")
        return WRITE_FAILED
    if code == pytest.ExitCode.INTERRUPTED:
        raise KeyboardInterrupt
    if code == pytest.ExitCode.USAGE_ERROR:  # a session-start check refused: relay its line
        errors = [x.removeprefix("ERROR: ") for x in lines if x.startswith("ERROR: ")]
        say(f"poros bench: error: {errors[0] if errors else f'the suites refused to start; see {log.path}'}")
        return 2
    if code == pytest.ExitCode.INTERNAL_ERROR:
        say("\n".join(lines[-30:]))
        say(f"poros bench: internal error (a bug in Poros); the full log is {log.path}")
        return 3
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        say(f"poros bench: no cell matched -k {args.keyword!r}" if args.keyword else "poros bench: no cells")
        return 1
    say(f"{tally.summary()} in {time.perf_counter() - t0:.0f} s; full log: {log.path}")
    if compare:
        checks = f", against {' '.join(args.benchmark_compare_fail)}" if args.benchmark_compare_fail else ""
        say(f"compared {tally.compared} timed cell(s) with {compare}{checks}: "
            f"{len(tally.regressions) or 'no'} regression(s); the table is in {log.path}")
    for line in tally.regressions:
        say(f"poros bench: slower than {compare}: {line}")
    if tally.no_progress:
        say(f"poros bench: {tally.no_progress}")
        return 1
    if code == OUT_OF_TIME:
        why = (f"at the time budget (--max-minutes {args.max_minutes:g})" if tally.stopped or args.passes_per_part is None
               else f"after {args.passes_per_part} pass(es) of each cell (--passes-per-part)")
        say(f"poros bench: stopped {why} with cells left; finished passes are kept in {out / 'passes.jsonl'}. "
            f"Continue with:\n  {command_line(args, resume=True)}")
    if not (results.exists() and ResultsWriter(results).rows()):
        if code == OUT_OF_TIME:
            return OUT_OF_TIME
        say("poros bench: no cell produced a result")
        return 1

    md = write_report([results], out / "report.md", reference_csv=reference_path(args.reference))
    say(f"wrote {md}")
    print(md.read_text(), flush=True)
    return int(code)
