"""`poros` command line: one module per subcommand, each with real example calls in its epilog."""

from __future__ import annotations

import argparse
import importlib
import sys

from poros.errors import PorosError

SUBCOMMANDS = ("env", "plan", "parity", "bench", "report", "validate", "build", "train")


class Parser(argparse.ArgumentParser):
    """Keeps each epilog's example lines as written; subcommand parsers inherit the class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="poros",
        description="QLoRA with blockwise residency: benchmark and validate bitwise parity.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"poros.cli.{name}").add_parser(sub)
    return parser


def wants_determinism(args) -> bool:
    """Whether the command will train with `deterministic`: its flag, or the matrix file it runs."""
    if getattr(args, "deterministic", None):
        return True
    if args.command == "bench" and getattr(args, "file", None):
        from poros.matrix import load_matrix

        return bool(load_matrix(args.file).deterministic)
    return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if wants_determinism(args):
            # before any command touches CUDA: cuBLAS reads its workspace configuration once per process
            from poros.train import set_cublas_workspace

            set_cublas_workspace()
        return int(args.run(args) or 0)
    except PorosError as e:
        print(f"poros {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"poros {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
