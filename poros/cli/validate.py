"""`poros validate`: check matrix files without running them."""

from __future__ import annotations

from poros.config import Method
from poros.errors import ConfigError
from poros.paths import path_arg
from poros.harness import preflight

EPILOG = """examples:
  poros validate matrices/h200.yaml
  poros validate matrices/*.yaml

Checks each file's settings and, against each model's config (a checkpoint folder's config.json
included), that seq_len is within the model's max_position_embeddings and that Poros supports its
layers. A file naming a reference (`reference: B300`, hardware as reports/reference/official.csv
names it) must run that reference's whole protocol: steps, passes, warm-up (warmup_passes,
warmup_pass_steps), seq_len, batch_size, grad_accum, lora_rank, lora_alpha, block_size, dataset,
precision, the stacks its rows state, and each method on the attention path its attention_note gives
it; each difference is one line.
The device is not checked here (a file may be meant for another machine), but for a matrix that runs on
the CPU its rank count (gpus, sweep.gpus) is: its ranks are processes of this host, refused as `poros
bench` refuses them.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="validate matrix files", epilog=EPILOG)
    p.add_argument("files", nargs="+", type=path_arg, help="matrix files or names (cpu, h200, ...)")
    p.set_defaults(run=run)


def _counted(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def cell_product(m) -> str:
    """How a matrix's timed cells multiply: every model x stack x sweep point runs each method once and poros once
    per plan, e.g. `5 models × 2 sweep points × (2 methods + 8 poros plans)`."""
    others = [meth for meth in m.methods if not (m.plans and meth is Method.POROS)]
    per_point = _counted(len(others), "method")
    if m.plans:
        per_point = f"({per_point} + {_counted(len(m.plans), 'poros plan')})" if others else \
            _counted(len(m.plans), "poros plan")
    factors = [_counted(len(m.models), "model"), *([_counted(len(m.stacks), "stack")] if len(m.stacks) > 1 else []),
               *([_counted(len(m.points()), "sweep point")] if m.sweep else []), per_point]
    return " × ".join(factors)


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
        print(f"ok   {m.source}: {cell_product(m)} = {cells} timed cells")
    return 1 if bad else 0
