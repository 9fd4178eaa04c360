"""`poros bench matrix FILE -o OUT/`: run the matrix suites and render OUT/report.md."""

from __future__ import annotations

import sys
from pathlib import Path

from poros.cli.report import add_reference_argument, reference_path

EPILOG = """examples:
  poros bench matrix matrices/cpu.yaml -o out/
  poros bench matrix matrices/h200.yaml -o out/h200 --steps 20 --passes 3 -k qwen2.5-32b
  poros bench matrix matrices/h200.yaml -o out/h200 --resume      # continue a killed run

Writes OUT/results.jsonl (one line per finished cell), OUT/benchmark.json (pytest-benchmark)
and OUT/report.md (+ report.png). Exits non-zero if any cell failed, parity FAIL included.
"""

SUITES = Path(__file__).resolve().parent.parent.parent / "suites"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run benchmark matrices", epilog=EPILOG)
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    m = bsub.add_parser("matrix", help="run every cell of a matrix file", epilog=EPILOG)
    m.add_argument("file", help="matrix file or name (cpu, h200, b300, a100)")
    m.add_argument("-o", "--out", default="out", help="output folder (default: out/)")
    m.add_argument("--steps", type=int, help="steps per pass (reduced run; flagged in the report)")
    m.add_argument("--passes", type=int, help="timed passes (reduced run; flagged in the report)")
    m.add_argument("--parity-steps", type=int, help="optimizer steps of the parity gate (default 3)")
    m.add_argument("-k", dest="keyword", help="pytest -k expression over cell ids, e.g. 'qwen2.5-32b and poros'")
    m.add_argument("--resume", action="store_true", help="skip cells already in OUT/results.jsonl")
    add_reference_argument(m)
    m.set_defaults(run=run)


def run(args) -> int:
    import pytest

    from poros.errors import PorosError
    from poros.matrix import load_matrix, resolve_matrix_path

    load_matrix(args.file)  # refuse a malformed file before anything runs
    if not SUITES.is_dir():
        raise PorosError(f"suites folder not found at {SUITES}: install poros from a source checkout (pip install -e .)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    if results.exists() and not args.resume:
        results.rename(results.with_suffix(".jsonl.prev"))
        print(f"moved the previous {results} to {results.with_suffix('.jsonl.prev')}", file=sys.stderr)
    argv = [str(SUITES), f"--matrix={resolve_matrix_path(args.file)}", f"--results={results}",
            f"--benchmark-json={out / 'benchmark.json'}", "-p", "no:cacheprovider", "-q", "-rs"]
    for opt in ("steps", "passes", "parity_steps"):
        if getattr(args, opt) is not None:
            argv.append(f"--{opt.replace('_', '-')}={getattr(args, opt)}")
    if args.keyword:
        argv += ["-k", args.keyword]
    if args.resume:
        argv.append("--resume")
    code = pytest.main(argv)
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("poros bench: no cell matched", file=sys.stderr)
        return 1
    if results.exists() and results.stat().st_size:
        from poros.report import write_report

        md = write_report([results], out / "report.md", reference_csv=reference_path(args.reference))
        print(md.read_text())
        print(f"wrote {md}", file=sys.stderr)
    else:
        print("poros bench: no cell produced a result", file=sys.stderr)
        return 1
    return int(code)
