"""`poros report`: render saved results into the seed's Markdown tables and a s/step-vs-VRAM PNG."""

from __future__ import annotations

EPILOG = """examples:
  poros report out/results.jsonl -o reports/h200.md
  poros report out/results.jsonl -o reports/h200.md --reference ../shared/reference/seed_reference.csv
  poros report out/pr.jsonl out/un.jsonl -o reports/b300.md --title "Poros — Official Validation Results"

Later files win: a row repeating a (matrix, model, stack, method) cell replaces the earlier one.
The PNG is written beside the Markdown (same stem) and linked from it. -o must be a .md file
that is none of the inputs.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="render results (JSON Lines) into Markdown tables and a PNG", epilog=EPILOG)
    p.add_argument("results", nargs="+", metavar="RESULTS.jsonl", help="results files written by `poros bench`")
    p.add_argument("-o", "--output", required=True, metavar="FILE.md", help="Markdown file to write")
    p.add_argument("--reference", metavar="CSV", help="reference numbers (seed_reference.csv format) to compare")
    p.add_argument("--title", metavar="T", help="title prefix (default: 'Poros — Validation Results')")
    p.set_defaults(run=run)


def run(args) -> int:
    from poros.preflight import check_reference, check_report_paths
    from poros.report import latest, load_results, results_table, write_report

    check_report_paths(args.results, args.output, args.reference)  # never over its own input
    if args.reference:
        check_reference(args.reference)
    out = write_report(args.results, args.output, reference_csv=args.reference, title=args.title)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    df = latest(load_results(args.results))
    for hw, g in df.groupby("hardware", sort=False):
        print(f"\nResults — {hw}\n{results_table(g)}")
    return 0
