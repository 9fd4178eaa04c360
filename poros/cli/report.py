"""`poros report`: render saved results into the official Markdown tables and a PNG of what was measured."""

from __future__ import annotations

import re
import sys

from poros.errors import PorosError
from poros.paths import path_arg
from poros.harness.preflight import check_reference, check_report_paths
from poros.harness.report import (
    OFFICIAL_REFERENCE,
    failures,
    latest,
    load_results,
    results_table,
    timing_warning,
    write_report,
)
from poros.harness.report.check import RATIO_BAND, check_against

EPILOG = """examples:
  poros report out/results.jsonl -o reports/h200.md
  poros report out/results.jsonl -o reports/h200.md --reference        # beside the official figures
  poros report out/results.jsonl -o reports/h200.md --reference my_reference.csv
  poros report out/pr.jsonl out/un.jsonl -o reports/b300.md --title "Poros — Official Validation Results"
  poros report out/results.jsonl -o reports/h200-plans.md --sweep --title "Poros — plans on the H200"
  poros report out/ci/results.jsonl -o out/ci/cpu.md --check-against results/cpu/results.jsonl

Later files win: a row repeating a (matrix, model, stack, method, plan, sweep point) cell replaces the
earlier one. Exits 1 when a cell FAILs (a failed run or a parity FAIL), after writing the report.
--reference alone takes the official validation figures (reports/reference/official.csv, B300 and
A100); give it after the results files, or name a CSV in that format.
The PNG is written beside the Markdown (same stem) and linked from it: s/step against peak VRAM,
or on CPU, where there is no device memory, s/step per model and method. -o must be a .md file
that is none of the inputs.
--sweep renders a sweep page instead: every row (each poros plan and sweep point, every run and GPU),
each compared only with the reference of its own run on its own GPU, and a PNG per plot the rows hold
(STEM-budget: s/step against VRAM over the plans' budgets; STEM-seq, STEM-accum, STEM-gpus: tokens/s
against sequence length, gradient accumulation and GPUs).
--check-against ROWS holds this page to a committed page of the same matrix (the rows it is rendered
from): every cell's protocol (steps, passes, warm-up, settings, stack, bitsandbytes and peft) and parity
must equal the committed cell's, each difference one line naming the cell, else exit 1; a slowdown vs
resident outside --ratio-band (default 0.25: ±25%) of the committed one is printed as a warning.
"""


def add_reference_argument(p) -> None:
    """`--reference [CSV]`, shared with `poros bench matrix`: alone, the official figures."""
    p.add_argument("--reference", nargs="?", const=True, metavar="CSV", type=path_arg,
                   help="reference figures to set beside the measured ones; alone: the official B300 and A100 "
                        "figures (reports/reference/official.csv)")


def reference_path(value):
    """The CSV `--reference` names: None when not given, the official figures when given alone."""
    if value is True:

        return OFFICIAL_REFERENCE
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="render results (JSON Lines) into Markdown tables and a PNG", epilog=EPILOG)
    p.add_argument("results", nargs="+", metavar="RESULTS.jsonl", type=path_arg, help="results files written by `poros bench`")
    p.add_argument("-o", "--output", required=True, metavar="FILE.md", type=path_arg, help="Markdown file to write")
    add_reference_argument(p)
    p.add_argument("--title", metavar="T", help="title prefix (default: 'Poros — Validation Results')")
    p.add_argument("--sweep", action="store_true",
                   help="a sweep page: every row, ratios within one run on one GPU, a plot per swept axis")
    p.add_argument("--check-against", metavar="ROWS.jsonl", nargs="+",
                   help="the committed page's results files: protocol and parity must match them cell by cell")
    p.add_argument("--ratio-band", type=float, default=RATIO_BAND, metavar="SHARE",
                   help=f"with --check-against: warn where a slowdown differs more than this share from the "
                        f"committed one (default {RATIO_BAND})")
    p.set_defaults(run=run)


def run(args) -> int:
    reference = reference_path(args.reference)
    check_report_paths(args.results, args.output, reference)  # never over its own input
    if args.title is not None and ("\n" in args.title or "\r" in args.title or not args.title.strip()):
        raise PorosError(f"--title: expected one line of text (the page's heading), got {args.title[:80]!r}")
    if reference and args.sweep:
        raise PorosError("--reference and --sweep: a sweep page has no reference table; leave one out")
    if reference:
        check_reference(reference)
    if args.check_against and args.sweep:
        raise PorosError("--check-against and --sweep: the check holds a matrix page to its committed one; leave one out")
    if not args.ratio_band > 0:
        raise PorosError(f"--ratio-band: expected a share > 0 (0.25 is ±25%), got {args.ratio_band!r}")
    committed = load_results(args.check_against) if args.check_against else None
    out = write_report(args.results, args.output, reference_csv=reference, title=args.title, sweep=args.sweep)
    df = load_results(args.results)
    if args.sweep:
        pngs = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", out.read_text())
        print(f"wrote {out}" + "".join(f", {out.with_name(p)}" for p in pngs))
    else:
        print(f"wrote {out} and {out.with_suffix('.png')}")
        for hw, g in latest(df).groupby("hardware", sort=False):
            warning = timing_warning(g)
            print(f"\nResults — {hw}\n" + (f"{warning}\n\n" if warning else "") + results_table(g))
    failed = failures(df, sweep=args.sweep)
    if failed:
        print(f"poros report: {len(failed)} cell(s) FAIL: " + "; ".join(failed), file=sys.stderr)
    if committed is not None and print_check(check_against(df, committed, args.ratio_band), args):
        return 1
    return 1 if failed else 0


def print_check(found, args) -> bool:
    """Print what the check against the committed page found; whether it failed."""
    against = " ".join(args.check_against)
    for line in found.warnings:
        print(f"warning: {line}")
    if found.problems:
        print(f"poros report: {out_name(args)} differs from the committed page ({against}) in "
              f"{len(found.problems)} place(s):", file=sys.stderr)
        for line in found.problems:
            print(f"  - {line}", file=sys.stderr)
        return True
    print(f"checked against {against}: protocol and parity match in all {found.cells} cells; "
          f"{len(found.warnings)} slowdown(s) outside ±{args.ratio_band:.0%} of the committed ones")
    return False


def out_name(args) -> str:
    return str(args.output)
