"""`poros validate`: check matrix files without running them."""

from __future__ import annotations

from poros.errors import ConfigError
from poros.paths import path_arg
from poros.harness import preflight

EPILOG = """examples:
  poros validate matrices/h200.yaml
  poros validate matrices/*.yaml

Checks each file's settings and, against each model's config (a checkpoint folder's config.json
included), that seq_len is within the model's max_position_embeddings and that Poros supports its
layers. A file naming a reference (`reference: B300`, hardware as reports/reference/official.csv
names it) must run each method on the attention path that reference's attention_note gives it.
The device is not checked here: a file may be meant for another machine.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="validate matrix files", epilog=EPILOG)
    p.add_argument("files", nargs="+", type=path_arg, help="matrix files or names (cpu, h200, ...)")
    p.set_defaults(run=run)


def run(args) -> int:
    from poros.harness.cells import matrix_cells

    bad = 0
    for f in args.files:
        try:
            m = preflight.load_matrix(f)
            preflight.check_matrix(m)
        except ConfigError as e:
            bad += 1
            print(f"FAIL {e.source}:")
            for p in e.problems:
                print(f"  - {p}")
            continue
        cells = sum(c.method is not None for c in matrix_cells(m))
        axes = [f"{len(m.models)} models", f"{len(m.stacks)} stacks", f"{len(m.methods)} methods",
                *([f"{len(m.points())} sweep points"] if m.sweep else []), *([f"{len(m.plans)} poros plans"] if m.plans else [])]
        print(f"ok   {m.source}: {' × '.join(axes)} = {cells} timed cells")
    return 1 if bad else 0
