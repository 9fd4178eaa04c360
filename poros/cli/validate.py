"""`poros validate`: check matrix files without running them."""

from __future__ import annotations

EPILOG = """examples:
  poros validate matrices/h200.yaml
  poros validate matrices/*.yaml
"""


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="validate matrix files", epilog=EPILOG)
    p.add_argument("files", nargs="+", help="matrix files or names (cpu, h200, ...)")
    p.set_defaults(run=run)


def run(args) -> int:
    from poros.errors import ConfigError
    from poros.matrix import load_matrix

    bad = 0
    for f in args.files:
        try:
            m = load_matrix(f)
        except ConfigError as e:
            bad += 1
            print(f"FAIL {e.source}:")
            for p in e.problems:
                print(f"  - {p}")
            continue
        cells = len(m.models) * len(m.stacks) * len(m.methods)
        print(f"ok   {m.source}: {len(m.models)} models × {len(m.stacks)} stacks × {len(m.methods)} methods = {cells} cells")
    return 1 if bad else 0
